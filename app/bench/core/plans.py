"""In-process planning of the same requests a cluster runs: minimum descriptors, the raw
ceiling's descriptor sizes and the planner's CPU time, with the sidecar's own planner."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from app.kvcache.preset_registration import describe
from app.sim.commands import SimRequest
from app.sim.ranks import CacheParams, allocate_rank, preset_config
from app.sim.reference import BlockAllocator, Instance, empty_allocator
from app.transfer.planning.planner import Descriptors, MambaMode, PairPlanner, StepRequest

Pairs = Sequence[tuple[SimRequest, SimRequest]]

# Span index shifted above every user-space address, so runs never merge across registrations.
_SPAN_SHIFT = 48


def _instance(params: CacheParams, seed: int) -> Instance:
    config = preset_config(params)
    ranks = [
        allocate_rank(params, r, allocator=empty_allocator, config=config)
        for r in range(params.tp_size)
    ]
    return Instance(config, ranks, [describe(r) for r in ranks], BlockAllocator(config, seed))


def _span_keys(addr: np.ndarray, spans: list[tuple[int, int]]) -> np.ndarray:
    starts = np.array(sorted(p for p, _ in spans), dtype=np.int64)
    idx = np.searchsorted(starts, addr, side="right") - 1
    return addr.astype(np.int64) + (idx.astype(np.int64) << _SPAN_SHIFT)


@dataclass
class Submit:
    """One batch write the sidecar makes: a P rank, a step, the layers it covers."""

    p_rank: int
    step: int
    layers: tuple[int, ...]
    per_peer: dict[int, Descriptors]

    @property
    def lengths(self) -> np.ndarray:
        parts = [d.length for d in self.per_peer.values()]
        return np.concatenate(parts) if parts else np.empty(0, np.int64)

    @property
    def nbytes(self) -> int:
        return sum(d.nbytes for d in self.per_peer.values())


class PlanModel:
    """P and D instances shaped like a cluster's (address space only) with its planners."""

    def __init__(self, prefill: CacheParams, decode: CacheParams) -> None:
        self.p = _instance(prefill, 0)
        self.d = _instance(decode, 1)
        self.planners = [
            PairPlanner(self.p.descs[r], dict(enumerate(self.d.descs)))
            for r in range(len(self.p.ranks))
        ]
        self.layers = [c.index for c in self.p.config.model.layers]

    def steps(
        self, pairs: Pairs, chunk: int | None, *, bulk: bool, mamba_mode: MambaMode
    ) -> list[list[StepRequest]]:
        """The steps the simulated engine signals: chunked layer-wise, or one whole pass."""
        reqs = [(pr, dr) for pr, dr in pairs]
        longest = max(pr.prompt_len for pr, _ in reqs)
        size = chunk or longest
        bounds = [(0, longest)] if bulk else [(s, s + size) for s in range(0, longest, size)]
        out = []
        for start, end in bounds:
            out.append(
                [
                    StepRequest(
                        pr.id,
                        pr.prompt_len,
                        start,
                        min(end, pr.prompt_len),
                        tuple(np.asarray(b, np.int64) for b in pr.blocks),
                        tuple(np.asarray(b, np.int64) for b in dr.blocks),
                        mamba_mode,
                    )
                    for pr, dr in reqs
                    if start < pr.prompt_len
                ]
            )
        return out

    def submits(
        self,
        pairs: Pairs,
        chunk: int | None = None,
        *,
        bulk: bool = False,
        mamba_mode: MambaMode = MambaMode.NONE,
    ) -> list[Submit]:
        """What the sidecar submits: per step, per layer, per P rank, every D rank at once."""
        out = []
        for i, step in enumerate(self.steps(pairs, chunk, bulk=bulk, mamba_mode=mamba_mode)):
            for layer in self.layers:
                for r, planner in enumerate(self.planners):
                    plan = planner.plan_layer(layer, step)
                    if plan.per_peer:
                        out.append(Submit(r, i, (layer,), dict(plan.per_peer)))
        return out

    def min_descriptors(self, submits: Sequence[Submit], *, across_layers: bool) -> int:
        """Maximal contiguous runs per submission (layer-wise) or per P/D pair over every layer
        (bulk: everything after the last layer may go in one submission); never across two
        registered spans, which no single descriptor may cross."""
        groups: dict[tuple[int, ...], list[Descriptors]] = {}
        for s in submits:
            for d_rank, descs in s.per_peer.items():
                key = (s.p_rank, d_rank) if across_layers else (s.p_rank, d_rank, s.step, *s.layers)
                groups.setdefault(key, []).append(descs)
        total = 0
        for key, parts in groups.items():
            descs = Descriptors.concat(parts)
            p_spans = self.p.ranks[key[0]].spans()
            d_spans = self.d.ranks[key[1]].spans()
            keyed = Descriptors(
                _span_keys(descs.src, p_spans), _span_keys(descs.dst, d_spans), descs.length
            )
            total += keyed.coalesced().count
        return total

    def planning_cpu(
        self,
        pairs: Pairs,
        chunk: int | None = None,
        *,
        mamba_mode: MambaMode = MambaMode.NONE,
        repeat: int = 3,
    ) -> list[tuple[int, float]]:
        """(layer, CPU seconds) of planning each layer of each step on one P rank's stream
        thread (plan, then join the peers' descriptors); the median of ``repeat`` tries."""
        out = []
        for step in self.steps(pairs, chunk, bulk=False, mamba_mode=mamba_mode):
            for layer in self.layers:
                for planner in self.planners:
                    tries = []
                    for _ in range(repeat):
                        t0 = time.thread_time()
                        plan = planner.plan_layer(layer, step)
                        Descriptors.concat(list(plan.per_peer.values()))
                        tries.append(time.thread_time() - t0)
                    out.append((layer, float(np.median(tries))))
        return out
