"""What the bench compares, in-process: an all-layers (bulk) submission from the stream thread
is byte-exact and reaches the minimum descriptors, and the bench's minimum matches the planner."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np
import pytest

from app.bench.core.plans import PlanModel
from app.devices import CpuEvent
from app.kvcache.layout import KVLayout, LayoutMode
from app.kvcache.presets import load_preset
from app.sim.commands import SimRequest
from app.sim.executor import execute
from app.sim.fill import request_salt
from app.sim.kv_io import untouched, verify_request
from app.sim.ranks import CacheParams
from app.sim.reference import _prefill, blocks_needed, build_instance
from app.transfer.planning.planner import Descriptors, MambaMode, PairPlanner, StepRequest
from app.transfer.requests.stream import ALL_LAYERS, Batch, LayerResult, LayerTask, StreamThread

CASES = [  # model, layers, P TP, D TP, block size
    ("llama-3.1-8b", 4, 1, 1, 16),
    ("gpt-oss-20b", 4, 2, 1, 16),
    ("qwen3-next-80b-a3b", 4, 1, 2, 16),
]


def _send(
    planner: PairPlanner, layer: int, steps: list[StepRequest]
) -> tuple[list[LayerResult], list[int]]:
    """Run one task through a real stream thread; the writer copies in-process."""
    results: list[LayerResult] = []
    sizes: list[int] = []
    done = threading.Event()

    def write(session: str, src: np.ndarray, dst: np.ndarray, ln: np.ndarray) -> None:
        sizes.append(int(src.size))
        execute(Descriptors(src, dst, ln))

    def on_result(res: LayerResult) -> None:
        results.append(res)
        if len(results) == (len(planner.local.placements) if layer == ALL_LAYERS else 1):
            done.set()

    stream = StreamThread(
        "test", 4, write, on_result, lambda endpoint, ids: list(ids), lambda ids: None
    )
    try:
        batch = Batch("tcp://peer:1", "peer", planner, steps)
        stream.put(LayerTask(1, layer, CpuEvent(), [batch]), 5)
        assert done.wait(30)
    finally:
        stream.stop()
    return results, sizes


@pytest.mark.parametrize(("model", "layers", "p_tp", "d_tp", "bs"), CASES)
@pytest.mark.parametrize("mode", list(LayoutMode))
def test_all_layers_submission_is_exact_and_minimal(
    model: str, layers: int, p_tp: int, d_tp: int, bs: int, mode: LayoutMode
) -> None:
    spec = load_preset(model, layers=layers)
    lens = [300, 1000, 17]
    p = build_instance(
        spec, p_tp, bs, blocks_needed(spec, p_tp, bs, lens), mode=mode, kv_layout=KVLayout.HND
    )
    d = build_instance(
        spec,
        d_tp,
        bs,
        blocks_needed(spec, d_tp, bs, lens),
        mode=mode,
        kv_layout=KVLayout.HND,
        seed=3,
    )
    reqs = []
    for i, n in enumerate(lens):
        pb = p.allocate_request(n, decode=False, mamba_mode=MambaMode.NONE)
        db = d.allocate_request(n, decode=True, mamba_mode=MambaMode.NONE)
        reqs.append(StepRequest(f"r{i}", n, 0, n, pb, db))
    _prefill(p, reqs)
    params = {
        side: CacheParams(
            model,
            tp,
            bs,
            inst.config.num_blocks,
            layers=layers,
            layout_mode=mode.value,
            kv_layout="HND",
        )
        for side, tp, inst in (("p", p_tp, p), ("d", d_tp, d))
    }
    model_plans = PlanModel(params["p"], params["d"])
    pairs: Sequence[tuple[SimRequest, SimRequest]] = [
        (
            SimRequest(r.request_id, r.prompt_len, [b.tolist() for b in r.p_blocks]),
            SimRequest(r.request_id, r.prompt_len, [b.tolist() for b in r.d_blocks]),
        )
        for r in reqs
    ]
    bulk = model_plans.submits(pairs, bulk=True)
    want_bulk = model_plans.min_descriptors(bulk, across_layers=True)
    total = 0
    for rank in range(p_tp):
        planner = PairPlanner(p.descs[rank], dict(enumerate(d.descs)))
        results, sizes = _send(planner, ALL_LAYERS, reqs)
        assert len(sizes) <= 1  # one submission for every layer and peer
        assert sorted(r.layer for r in results) == [c.index for c in spec.layers]
        assert all(not r.failed for r in results)
        assert sum(r.descriptors for r in results) == sum(sizes)
        total += sum(sizes)
    assert total == want_bulk
    for rank in d.ranks:
        used: set[int] = set()
        for r in reqs:
            used.update(int(x) for ids in r.d_blocks for x in ids)
            salt = request_salt(r.request_id)
            assert verify_request(rank, r.d_blocks, r.prompt_len, salt=salt) == []
        assert untouched(rank, used) == []
    if mode is LayoutMode.CROSS_LAYER and model == "llama-3.1-8b":
        # One descriptor covers a block run of every layer; layer-wise, a block of one layer.
        layerwise = model_plans.min_descriptors(model_plans.submits(pairs), across_layers=False)
        assert total * layers <= layerwise
