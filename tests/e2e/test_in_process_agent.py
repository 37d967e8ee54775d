"""The agent hosted inside the engine process (``InProcessAgent``): the byte-exact matrix.

The same sidecar on a thread of the engine process, reached through the same engine socket;
the peer on the other side may run either way.
"""

from __future__ import annotations

from collections.abc import Callable

import httpx
import pytest

from app.sim.cluster import Cluster
from app.sim.rounds import summarize
from tests.e2e.test_layerwise_push import MODELS, PAIRS, arrive_byte_exact


# Each model once and each TP pair once: the agent on the engine's thread is the sidecar's own
# code, which test_layerwise_push.py runs over the whole model x pair matrix.
@pytest.mark.parametrize(("model", "p_tp", "d_tp"), [
    (model, *pair) for model, pair in zip(sorted(MODELS), PAIRS, strict=True)
])  # fmt: skip
def test_in_process_agents_arrive_byte_exact(
    make_cluster: Callable[..., Cluster], model: str, p_tp: int, d_tp: int
) -> None:
    cluster = arrive_byte_exact(make_cluster, model, p_tp, d_tp, in_process=("prefill", "decode"))
    assert all(side.sidecar is None for side in cluster.sides.values())


@pytest.mark.parametrize("hosted", ["prefill", "decode"])
def test_an_in_process_agent_pairs_with_a_sidecar_container(
    make_cluster: Callable[..., Cluster], hosted: str
) -> None:
    lens = [256, 130]
    cluster = make_cluster(
        model="gpt-oss-20b",
        layers=4,
        prefill_tp=2,
        decode_tp=1,
        max_requests=len(lens),
        max_prompt=max(lens),
        in_process=(hosted,),
    )
    assert cluster.sides[hosted].sidecar is None
    pairs = cluster.make_requests(lens)
    s = summarize(cluster.run(pairs), pairs)
    assert s["failures"] == {} and s["verified"] == len(lens)
    # Its admin API is served from the engine process too.
    status = httpx.get(f"{cluster.sides[hosted].admin_url}/v1/status", timeout=10).json()
    assert status["role"] == hosted, status
