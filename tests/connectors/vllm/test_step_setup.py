"""A step's setup runs before the forward pass, on its critical path (on a GPU it delays the
launch): the worker announces it with one one-way message and never waits for the sidecar.

The sidecar here is a real ZMQ socket that reads every frame and answers none (a hung
sidecar). With 8 requests in the batch (8 admissions, 8 expects, 8 slices), the setup must
return at once, cost at most 0.2 ms per step (median), and reach the sidecar as one
``BeginStep`` per step carrying all of it, in order.
"""

from __future__ import annotations

import statistics
import time

from app.connectors.vllm.config import ConnectorConfig
from app.connectors.vllm.metadata import Admit, Expect, KVSidecarMetadata
from app.connectors.vllm.worker import WorkerSide
from app.transfer.wire.protocol import (
    AddSend,
    BeginStep,
    ExpectRecv,
    RemoteTarget,
    StepSlice,
)
from tests.connectors.vllm.conftest import Silent

BATCH = 8
STEPS = 200
BUDGET_S = 0.2e-3
# Far above a host stall (0.57 s seen on a loaded 2-core CI machine): a step that waited
# for the silent sidecar would take all of it.
LINK_TIMEOUT_S = 10.0


def _meta(step: int) -> KVSidecarMetadata:
    blocks = [list(range(1 + 64 * i, 65 + 64 * i)) for i in range(2)]  # 2 groups, 64 blocks
    target = RemoteTarget("x", "127.0.0.1", 5555, "d", "epoch", 1, blocks)
    meta = KVSidecarMetadata()
    for i in range(BATCH):
        sid = f"s{step}-{i}"
        send = AddSend(rank=0, request=sid, prompt_len=1024, block_ids=blocks, remote=target)
        meta.admits.append(Admit(f"p{step}-{i}", send))
        recv = ExpectRecv(
            rank=0, request=f"r{step}-{i}", prompt_len=1024, block_ids=blocks, prefill_tp=1
        )
        meta.expects.append(Expect(f"d{step}-{i}", recv, 0, None))
        meta.slices.append(StepSlice(sid, 0, 1024))
    return meta


def test_step_setup_is_one_message_and_never_waits(silent: Silent) -> None:
    config = ConnectorConfig(silent.endpoint, "e", 1, 1, None, LINK_TIMEOUT_S)
    worker = WorkerSide(config, rank=3, vllm_config=None, kv_cache_config=None)
    metas = [_meta(step) for step in range(STEPS)]
    took = []
    try:
        for meta in metas:
            t0 = time.perf_counter()
            worker.begin_step(meta)
            took.append(time.perf_counter() - t0)
        got = silent.received()
    finally:
        worker.close()
    median = statistics.median(took)
    print(
        f"step setup, {BATCH} requests: median {median * 1e3:.3f} ms, max {max(took) * 1e3:.3f} ms"
    )
    # A round trip would have waited out the link timeout on the silent sidecar.
    assert max(took) < LINK_TIMEOUT_S / 2, max(took)
    assert median <= BUDGET_S, f"median {median * 1e3:.3f} ms per step > 0.2 ms"
    assert [type(m) for m in got] == [BeginStep] * STEPS
    first = got[0]
    assert isinstance(first, BeginStep)
    assert (first.rank, first.step) == (3, 1)
    assert [a.request for a in first.admits] == [f"s0-{i}" for i in range(BATCH)]
    assert {a.rank for a in first.admits} == {e.rank for e in first.expects} == {3}
    assert [s.request for s in first.slices] == [a.request for a in first.admits]
    assert [m.step for m in got if isinstance(m, BeginStep)] == list(range(1, STEPS + 1))
