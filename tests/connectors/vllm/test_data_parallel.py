"""Data parallel through P/D on real engines: every DP rank is an engine of its own.

Prefill and decode each run one vLLM server with ``--data-parallel-size 2``. vLLM suffixes
each DP engine's id with ``_dp<rank>``; each rank's connector links to a sidecar of its own
(``{dp}`` in its endpoint), and the proxy routes to (server, rank) pairs (``URL#dp<rank>``,
sent as vLLM's ``X-data-parallel-rank`` header). A request whose two sides met different
ranks than the proxy named would find no target or write into the wrong engine's blocks:
outputs, decode's computed tokens and each sidecar's own records catch both.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from app.harness.engines import prompt_tokens_by_source
from app.harness.local_pd import LocalPD
from app.harness.tiny_models import write_tiny_model
from tests.connectors.vllm.conftest import engines_up, prompt

pytestmark = pytest.mark.slow_engines

REQUESTS = 8
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def dp_pd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalPD]:
    root = tmp_path_factory.mktemp("dp")
    model = write_tiny_model(root / "model", "llama")
    stack = LocalPD(
        model,
        root / "run",
        recv_timeout_s=30.0,
        kind="llama",
        prefill_dp=2,
        decode_dp=2,
        # Spread by count, so both ranks of each server serve some of the 8.
        proxy_args=("--policy", "round_robin"),
    )
    with engines_up(stack):
        yield stack


def ended(admin: str, side: str) -> tuple[str, dict[str, str | None]]:
    """A sidecar's own engine id, and its ended requests of ``side``: id -> peer (a send's
    decode control endpoint)."""
    engine = httpx.get(f"{admin}/v1/status", timeout=10).json()["engine_id"]
    body = httpx.get(
        f"{admin}/v1/requests", params={"side": side, "ended": "true"}, timeout=10
    ).json()
    return str(engine), {r["id"]: r["peer"] for r in body["requests"]}


def test_every_dp_rank_serves_its_own_transfers(dp_pd: LocalPD) -> None:
    """8 concurrent requests: outputs equal one engine's, decode computed one token each, each
    record names both DP ranks, and each rank's sidecar moved exactly those requests."""
    pairs = [dp_pd.reference(prompt(40 + 7 * i, 900 + i), MAX_TOKENS) for i in range(REQUESTS)]
    before = prompt_tokens_by_source(dp_pd.decode.url)
    with ThreadPoolExecutor(REQUESTS) as pool:
        outs = list(pool.map(lambda p: dp_pd.complete(dp_pd.proxy, p[0], MAX_TOKENS), pairs))
    assert outs == [answer for _, answer in pairs]
    after = prompt_tokens_by_source(dp_pd.decode.url)
    assert after.get("local_compute", 0) - before.get("local_compute", 0) == REQUESTS
    assert after.get("external_kv_transfer", 0) - before.get("external_kv_transfer", 0) == sum(
        len(p) - 1 for p, _ in pairs
    )

    records = httpx.get(f"{dp_pd.proxy}/v1/transfers", params={"limit": REQUESTS}).json()
    records = records["transfers"]
    assert [r["status"] for r in records] == ["ok"] * REQUESTS, records
    served = Counter((r["prefill_dp_rank"], r["decode_dp_rank"]) for r in records)
    assert {p for p, _ in served} == {0, 1} and {d for _, d in served} == {0, 1}, served

    # Each rank's sidecar names itself with vLLM's suffix and moved exactly the transfers
    # the proxy sent to that rank: the record's prefill rank sent it, to the sidecar of the
    # record's decode rank, which received it.
    control = {inst.name: f"tcp://127.0.0.1:{inst.control_port}" for inst in dp_pd.instances}
    sends: dict[str, tuple[str, str | None]] = {}
    recvs: dict[str, str] = {}
    for inst in dp_pd.prefill_instances:
        engine, seen = ended(inst.admin, "send")
        assert engine == inst.name
        sends |= {tid: (engine, peer) for tid, peer in seen.items()}
    for inst in dp_pd.decode_instances:
        engine, seen = ended(inst.admin, "recv")
        assert engine == inst.name
        recvs |= dict.fromkeys(seen, engine)
    for r in records:
        tid, decode = r["transfer_id"], f"decode_dp{r['decode_dp_rank']}"
        assert sends.get(tid) == (f"prefill_dp{r['prefill_dp_rank']}", control[decode]), r
        assert recvs.get(tid) == decode, r
