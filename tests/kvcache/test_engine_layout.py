"""Layouts built from an engine's registration move each head's pages to the right rank.

The registrations mimic what vLLM 0.32's CPU backend hands a connector: one 4D view per layer,
``[kernel blocks, heads, tokens, K|V channels]``, layers of a group at a layer stride in one
buffer. Descriptors are executed as plain byte copies; the oracle is the logical tensor (global
head, token position) on each rank, filled and checked with torch indexing, never with the
planner's pieces. Catches: a wrong head offset or unit for a TP pairing, a replicated head sent
twice or from the wrong rank, the layer stride or block stride misread, a sliding window sent
from the wrong end, a write into the null block or a block outside the request.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from app.errors import ConfigError
from app.kvcache.engine_layout import describe_engine, engine_compat_hash
from app.kvcache.engine_spec import Axis, EngineGroup, EngineLayer, EngineRegistration, MemorySpan
from app.kvcache.specs import held_units
from app.transfer.planning.planner import PairPlanner, StepRequest

HEADS, HEAD, KB, BLOCKS, LAYERS = 4, 64, 16, 12, 2
CH = 2 * HEAD  # K then V channels per token row


def registration(tp: int, rank: int, window: int | None = None) -> EngineRegistration:
    heads = max(1, HEADS // tp)
    page = heads * KB * CH  # elements
    groups = [EngineGroup("full", KB, KB, ["model.layers.0.attn"])]
    names = ["model.layers.0.attn", "model.layers.1.attn"]
    if window:
        groups = [
            EngineGroup("sliding", KB, KB, [names[0]], sliding_window=window),
            EngineGroup("full", KB, KB, [names[1]]),
        ]
    else:
        groups[0].layers.append(names[1])
    layers = [
        EngineLayer(
            name=name,
            group=0 if not window else i,
            buffer=0,
            offset=i * BLOCKS * page * 2,
            dtype="bfloat16",
            axes=[
                Axis("block", BLOCKS, page),
                Axis("head", heads, KB * CH),
                Axis("token", KB, CH),
                Axis("channel", CH, 1),
            ],
            head_size=HEAD,
            head_size_v=HEAD,
            total_heads=HEADS,
        )
        for i, name in enumerate(names)
    ]
    return EngineRegistration(
        engine_id=f"e{tp}",
        rank=rank,
        tp_size=tp,
        model="tiny",
        engine_version="0.32.0",
        num_blocks=BLOCKS,
        groups=groups,
        layers=layers,
        memory=[MemorySpan("kv", 0, LAYERS * BLOCKS * page * 2)],
    )


class Rank:
    """One engine rank: its buffer, its logical per-layer views and its layout."""

    def __init__(self, tp: int, rank: int, window: int | None = None) -> None:
        self.reg = registration(tp, rank, window)
        self.buf = torch.zeros(self.reg.memory[0].size, dtype=torch.uint8)
        self.desc = describe_engine(self.reg, [self.buf.data_ptr()])
        self.first, self.count = held_units(rank, tp, HEADS)

    def view(self, layer: int) -> torch.Tensor:
        spec = self.reg.layers[layer]
        return self.buf.view(torch.bfloat16).as_strided(
            [a.size for a in spec.axes], [a.stride for a in spec.axes], spec.offset // 2
        )


def fill(rank: Rank) -> None:
    """Value of (layer, global head, block id, token row, channel), exact in bf16."""
    for layer in range(LAYERS):
        v = rank.view(layer)
        for b in range(BLOCKS):
            for h in range(rank.count):
                g = rank.first + h
                base = (layer * 7 + g * 31 + b * 13) % 97
                row = torch.arange(KB).unsqueeze(1) * 3 + torch.arange(CH).unsqueeze(0)
                v[b, h] = ((row + base) % 251).to(torch.bfloat16) + 1


def run(p_tp: int, d_tp: int, prompt: int, p_ids: list[int], d_ids: list[int], window=None):
    ps = [Rank(p_tp, r, window) for r in range(p_tp)]
    ds = [Rank(d_tp, r, window) for r in range(d_tp)]
    for p in ps:
        fill(p)
    for d in ds:
        d.buf.fill_(0x5A)
    sentinel = [d.buf.clone() for d in ds]
    groups = len(ps[0].reg.groups)
    req = StepRequest(
        "r",
        prompt,
        0,
        prompt,
        tuple(np.asarray(p_ids, np.int64) for _ in range(groups)),
        tuple(np.asarray(d_ids, np.int64) for _ in range(groups)),
    )
    base = {id(d): d.buf.data_ptr() for d in ds}
    written = dict.fromkeys(range(d_tp), 0)
    for p in ps:
        planner = PairPlanner(p.desc, {d.desc.rank: d.desc for d in ds})
        for layer in range(LAYERS):
            plan = planner.plan_layer(layer, [req])
            assert not plan.failed, plan.failed
            for d_rank, descs in plan.per_peer.items():
                d = ds[d_rank]
                for s, t, n in zip(descs.src, descs.dst, descs.length, strict=True):
                    so, to = int(s) - p.buf.data_ptr(), int(t) - base[id(d)]
                    d.buf[to : to + int(n)] = p.buf[so : so + int(n)]
                    written[d_rank] += int(n)
    return ps, ds, sentinel, written


def holder(ps: list[Rank], head: int) -> Rank:
    return next(p for p in ps if p.first <= head < p.first + p.count)


@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 1), (2, 1), (1, 2), (4, 2), (2, 4), (4, 1), (1, 4)])
def test_every_head_page_lands_on_its_rank(p_tp: int, d_tp: int) -> None:
    prompt = 3 * KB + 5  # a partial last kernel block
    p_ids, d_ids = [7, 2, 9, 4], [3, 8, 1, 10]
    ps, ds, sentinel, written = run(p_tp, d_tp, prompt, p_ids, d_ids)
    for d in ds:
        # Each head page once: a head held by two prefill ranks is sent by one of them only.
        assert written[d.desc.rank] == LAYERS * len(d_ids) * d.count * KB * CH * 2
        for layer in range(LAYERS):
            got = d.view(layer)
            for h in range(d.count):
                p = holder(ps, d.first + h)
                src = p.view(layer)
                for pb, db in zip(p_ids, d_ids, strict=True):
                    assert torch.equal(got[db, h], src[pb, d.first + h - p.first]), (layer, h, db)
        # Nothing outside the request's blocks changed (null block 0 included).
        untouched = [b for b in range(BLOCKS) if b not in d_ids]
        for layer in range(LAYERS):
            before = sentinel[d.desc.rank].view(torch.bfloat16)
            spec = d.reg.layers[layer]
            old = before.as_strided(
                [a.size for a in spec.axes], [a.stride for a in spec.axes], spec.offset // 2
            )
            for b in untouched:
                assert torch.equal(d.view(layer)[b], old[b]), (layer, b)


def test_replicated_heads_come_from_their_first_holder() -> None:
    # 2 heads over TP 4 on both sides: each head on two ranks; D's replicas both receive it.
    global HEADS
    saved, HEADS = HEADS, 2
    try:
        ps, ds, _, written = run(4, 4, KB * 2, [5, 6], [1, 2])
        for d in ds:
            assert written[d.desc.rank] == LAYERS * 2 * KB * CH * 2  # once, not twice
            p = holder(ps, d.first)
            assert torch.equal(d.view(0)[1, 0], p.view(0)[5, 0])
    finally:
        HEADS = saved


def test_sliding_window_sends_only_the_blocks_decode_reads() -> None:
    prompt = 4 * KB + 3  # 5 kernel blocks; a 20-token window reads the last cdiv(19,16)+1 = 3
    p_ids, d_ids = [1, 2, 3, 4, 5], [6, 7, 8, 9, 10]
    ps, ds, sentinel, _ = run(1, 1, prompt, p_ids, d_ids, window=20)
    d, p = ds[0], ps[0]
    before = sentinel[0].view(torch.bfloat16)
    spec = d.reg.layers[0]
    old = before.as_strided([a.size for a in spec.axes], [a.stride for a in spec.axes], 0)
    for j, (pb, db) in enumerate(zip(p_ids, d_ids, strict=True)):
        sent = torch.equal(d.view(0)[db], p.view(0)[pb])
        assert sent == (j >= 2), j  # sliding layer: only the last three
        assert torch.equal(d.view(1)[db], p.view(1)[pb])  # full layer: all
        if j < 2:
            assert torch.equal(d.view(0)[db], old[db])


def test_registration_that_overruns_its_memory_is_refused() -> None:
    reg = registration(1, 0)
    reg.memory[0].size -= 2
    with pytest.raises(ConfigError, match="reach byte"):
        describe_engine(reg, [0])


def test_heads_that_do_not_match_the_tp_size_are_refused() -> None:
    reg = registration(2, 0)
    reg.layers[0].axes[1] = Axis("head", 4, KB * CH)
    with pytest.raises(ConfigError, match="KV heads"):
        describe_engine(reg, [0])


def test_compat_hash_ignores_tp_and_block_size_but_not_the_model() -> None:
    assert engine_compat_hash(registration(1, 0)) == engine_compat_hash(registration(4, 2))
    other = registration(1, 0)
    other.layers[0].total_heads = 8
    assert engine_compat_hash(other) != engine_compat_hash(registration(1, 0))
