"""``KVSIDECAR_CONTROL_MAX_FRAME_BYTES`` is the cap a running sidecar's control port enforces."""

from __future__ import annotations

from collections.abc import Callable

from app.sim.cluster import Cluster
from app.transfer.wire.protocol import Error, PoolLookup
from tests.e2e.conftest import ask_control

CAP = 64 << 10


def test_the_control_port_refuses_frames_over_the_configured_cap(
    make_cluster: Callable[..., Cluster],
) -> None:
    c = make_cluster(
        model="gpt-oss-20b",
        layers=2,
        prefill_tp=1,
        decode_tp=1,
        max_requests=1,
        max_prompt=256,
        decode_env={"KVSIDECAR_CONTROL_MAX_FRAME_BYTES": str(CAP)},
    )
    port = c.sides["decode"].control_port
    # Well under the default cap of 1 MiB, over this one; a token id is one msgpack byte.
    over = ask_control(
        port, PoolLookup(rank=0, request="big", token_ids=[1] * (2 * CAP)), sealed_reply=False
    )
    assert isinstance(over, Error) and "too large" in over.reason, over
    under = ask_control(port, PoolLookup(rank=0, request="small", token_ids=[1] * (CAP // 2)))
    assert not (isinstance(under, Error) and "too large" in under.reason), under
