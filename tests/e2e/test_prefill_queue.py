"""A request that waits in prefill's queue longer than decode's writes bound still lands:
decode's receive waits ``recv_queue_timeout_s`` for prefill's claim, and ``recv_timeout_s``
counts from the claim (real sidecars, real Mooncake, the simulator's byte-exact oracle)."""

from __future__ import annotations

from collections.abc import Callable

from app.sim.cluster import Cluster
from app.sim.rounds import summarize

WRITES_S = 3.0  # decode's recv_timeout_s, as the connector passes it with each receive
QUEUED_S = 2 * WRITES_S + 1  # how long prefill "queues" the requests before it starts them


def test_a_request_queued_at_prefill_past_the_writes_bound_lands(
    make_cluster: Callable[..., Cluster],
) -> None:
    cluster = make_cluster(
        model="gpt-oss-20b",
        layers=2,
        max_requests=2,
        max_prompt=257,
        decode_env={"KVSIDECAR_RECV_QUEUE_TIMEOUT_S": "30"},
    )
    pairs = cluster.make_requests([257, 65])
    result = cluster.run(pairs, timeout_s=WRITES_S, queued_s=QUEUED_S)
    s = summarize(result, pairs)
    # With the deadline counted from decode's admission both would end EXPIRED here.
    assert s["failures"] == {}
    assert s["verified"] == len(pairs)
