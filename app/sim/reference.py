"""In-process P/D instances and a full reference transfer: fill, plan, copy, verify.

Used by the property tests and by ``kv-sidecar plan``; the real transfer path (Mooncake, ZMQ,
separate processes) reuses the same instances, block allocation and oracle.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from app.kvcache.desc import LayoutDesc
from app.kvcache.groups import (
    NULL_BLOCK,
    CacheConfig,
    blocks_for_tokens,
    build_cache_config,
)
from app.kvcache.layout import KVLayout, LayoutMode, RankLayout, allocate, zeros_allocator
from app.kvcache.preset_registration import describe
from app.kvcache.presets import ModelSpec
from app.kvcache.specs import SpecKind
from app.sim.executor import execute
from app.sim.fill import request_salt
from app.sim.kv_io import untouched, verify_request, write_state, write_tokens
from app.transfer.planning.planner import Descriptors, MambaMode, PairPlanner, StepRequest


def empty_allocator(nbytes: int) -> torch.Tensor:
    """Address space only (pages are never touched): enough for planning."""
    return torch.empty(nbytes, dtype=torch.uint8)


class BlockAllocator:
    """Hands out block ids as vLLM's managers would, for every group of one instance."""

    def __init__(self, config: CacheConfig, seed: int = 0) -> None:
        self.config = config
        # Runs of 4 contiguous ids in shuffled order: plans see both runs and breaks.
        ids = np.arange(1, config.num_blocks)
        runs = [ids[i : i + 4] for i in range(0, ids.size, 4)]
        order = np.random.default_rng(seed).permutation(len(runs))
        self.free = [int(b) for i in order for b in runs[i]][::-1]

    def take(self, n: int) -> np.ndarray:
        if n > len(self.free):
            raise MemoryError(f"need {n} blocks, {len(self.free)} free")
        return np.array([self.free.pop() for _ in range(n)], np.int64)

    def release(self, blocks: Sequence[np.ndarray]) -> None:
        self.free.extend(int(b) for ids in blocks for b in ids if b != NULL_BLOCK)

    def allocate_request(
        self, prompt_len: int, *, decode: bool, mamba_mode: MambaMode, num_spec: int = 0
    ) -> tuple[np.ndarray, ...]:
        """Block ids per group for a prompt; decode maps skipped sliding blocks to null."""
        out = []
        for g in self.config.groups:
            n = blocks_for_tokens(prompt_len, g.block_size)
            if decode and g.kind is not SpecKind.MAMBA:
                # vLLM allocates decode's blocks for the prompt_len - 1 tokens it loads.
                n = blocks_for_tokens(prompt_len - 1, g.block_size)
            if g.kind is SpecKind.MAMBA:
                n = 1 if mamba_mode is MambaMode.NONE else n + num_spec
                out.append(self.take(n))
            elif decode and g.kind is SpecKind.SLIDING and g.sliding_window:
                # vLLM's SlidingWindowManager: prompt_len - 1 tokens arrive computed, and the
                # get_num_skipped_tokens(prompt_len - 1) tokens before the window get null.
                skipped = min(n, max(0, prompt_len - 1 - g.sliding_window + 1) // g.block_size)
                ids = np.full(n, NULL_BLOCK, np.int64)
                ids[skipped:] = self.take(n - skipped)
                out.append(ids)
            else:
                out.append(self.take(n))
        return tuple(out)


@dataclass
class Instance:
    """One P or D instance: every TP rank's layout on this process."""

    config: CacheConfig
    ranks: list[RankLayout]
    descs: list[LayoutDesc]
    blocks: BlockAllocator

    def allocate_request(
        self, prompt_len: int, *, decode: bool, mamba_mode: MambaMode, num_spec: int = 0
    ) -> tuple[np.ndarray, ...]:
        return self.blocks.allocate_request(
            prompt_len, decode=decode, mamba_mode=mamba_mode, num_spec=num_spec
        )


def build_instance(
    model: ModelSpec,
    tp: int,
    block_size: int,
    num_blocks: int,
    *,
    mode: LayoutMode,
    kv_layout: KVLayout,
    heads_major: bool = False,
    allocator: Callable[[int], torch.Tensor] = zeros_allocator,
    seed: int = 0,
) -> Instance:
    config = build_cache_config(model, tp, block_size, num_blocks=num_blocks)
    ranks = [
        allocate(
            config, r, mode=mode, kv_layout=kv_layout, heads_major=heads_major, allocator=allocator
        )
        for r in range(tp)
    ]
    return Instance(config, ranks, [describe(r) for r in ranks], BlockAllocator(config, seed))


def blocks_needed(
    model: ModelSpec, tp: int, block_size: int, prompt_lens: Sequence[int], num_spec: int = 0
) -> int:
    """Blocks (null included) that ``prompt_lens`` need on an instance, with align-mode slack."""
    probe = build_cache_config(model, tp, block_size, num_blocks=2)
    total = 1
    for n in prompt_lens:
        for g in probe.groups:
            total += blocks_for_tokens(n, g.block_size) + num_spec
    return total + 8


@dataclass
class TransferResult:
    bytes: int = 0
    descriptors: int = 0
    blocks: int = 0
    planning_s: float = 0.0
    per_group: dict[int, list[int]] = field(default_factory=dict)  # group -> [blocks, descs, bytes]
    plans: list[tuple[int, int, int, Descriptors]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)


def run_transfer(
    p: Instance,
    d: Instance,
    prompt_lens: Sequence[int],
    *,
    chunk: int | None = None,
    bulk: bool = False,
    mamba_mode: MambaMode = MambaMode.NONE,
    num_spec: int = 0,
    fill: bool = True,
    copy: bool = True,
    verify: bool = True,
    keep_plans: bool = False,
) -> TransferResult:
    """Prefill every request (chunked), plan each layer per step per P rank, copy, verify D."""
    res = TransferResult()
    reqs = []
    for i, n in enumerate(prompt_lens):
        pb = p.allocate_request(n, decode=False, mamba_mode=mamba_mode, num_spec=num_spec)
        db = d.allocate_request(n, decode=True, mamba_mode=mamba_mode, num_spec=num_spec)
        reqs.append((f"req-{i}", n, pb, db))
    planners = [PairPlanner(p.descs[r], dict(enumerate(d.descs))) for r in range(len(p.ranks))]
    longest = max(prompt_lens)
    step = chunk or longest
    bounds = [(s, min(s + step, longest)) for s in range(0, longest, step)]
    layers = [c.index for c in p.config.model.layers]
    for start, end in bounds:
        steps = [
            StepRequest(rid, n, start, min(end, n), pb, db, mamba_mode, num_spec)
            for rid, n, pb, db in reqs
            if start < n
        ]
        if fill:
            _prefill(p, steps)
        if bulk:
            continue
        for layer in layers:
            _plan_and_copy(planners, [layer], steps, res, copy, keep_plans)
    if bulk:
        # Bulk sends whole requests after the last layer of the last step.
        whole = [StepRequest(rid, n, 0, n, pb, db, mamba_mode, num_spec) for rid, n, pb, db in reqs]
        _plan_and_copy(planners, layers, whole, res, copy, keep_plans)
    if verify:
        for rank in d.ranks:
            used: set[int] = set()
            for rid, n, _, db in reqs:
                if rid in res.failed:
                    continue
                used.update(int(x) for ids in db for x in ids)
                res.problems += [
                    f"{rid}: {m}"
                    for m in verify_request(
                        rank, db, n, mamba_mode.value, num_spec, request_salt(rid)
                    )
                ]
            res.problems += untouched(rank, used)
    return res


def _prefill(p: Instance, steps: Sequence[StepRequest]) -> None:
    for rank in p.ranks:
        for g in p.config.groups:
            for c in g.layers:
                for s in steps:
                    ids = s.p_blocks[g.index]
                    if g.kind is SpecKind.MAMBA:
                        if s.last:
                            idx = 0 if s.mamba_mode is MambaMode.NONE else ids.size - 1 - s.num_spec
                            write_state(
                                rank,
                                c.index,
                                int(ids[idx]),
                                s.prompt_len - 1,
                                request_salt(s.request_id),
                            )
                    else:
                        write_tokens(rank, c.index, ids, s.start, s.end, request_salt(s.request_id))


def _plan_and_copy(
    planners: Sequence[PairPlanner],
    layers: Sequence[int],
    steps: Sequence[StepRequest],
    res: TransferResult,
    copy: bool,
    keep: bool,
) -> None:
    """Plan ``layers`` as one submission per (P rank, D rank); bulk mode passes all layers."""
    for pr, planner in enumerate(planners):
        t0 = time.perf_counter()
        per_peer: dict[int, list[Descriptors]] = {}
        for layer in layers:
            plan = planner.plan_layer(layer, steps)
            res.failed.update(plan.failed)
            g = res.per_group.setdefault(plan.group, [0, 0, 0])
            for dr, descs in plan.per_peer.items():
                per_peer.setdefault(dr, []).append(descs)
                g[0] += plan.blocks.get(dr, 0)
                res.blocks += plan.blocks.get(dr, 0)
                if len(layers) == 1:
                    g[1] += descs.count
                g[2] += descs.nbytes
        merged = {
            dr: Descriptors.concat(ds).coalesced() if len(layers) > 1 else ds[0]
            for dr, ds in per_peer.items()
        }
        res.planning_s += time.perf_counter() - t0
        for dr, descs in merged.items():
            res.descriptors += descs.count
            res.bytes += descs.nbytes
            if keep:
                res.plans.append((pr, dr, layers[0] if len(layers) == 1 else -1, descs))
            if copy:
                execute(descs)
