"""The transfer planner (DESIGN §3, §5): pure numpy, no I/O.

For one P rank, a step of one or more requests and a layer, it gives per D rank the descriptors
``(src, dst, length)`` coalesced into maximal runs, every one bound-checked against the D rank's
advertised regions. Blocks are addressed in *kernel* blocks on both sides: token-kernel-block j
lives in manager block ``ids[j // r]``, kernel block ``j % r`` of that side, so two sides may use
different manager block sizes as long as their kernel blocks match.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

import numpy as np

from app.errors import LayoutMismatchError, OutOfBoundsError
from app.kvcache.desc import LayoutDesc
from app.kvcache.layout import LayerPlacement
from app.kvcache.specs import RegionKind, SpecKind
from app.transfer.planning.tp_mapping import Template, coalesce, layer_template


class MambaMode(StrEnum):
    NONE = "none"
    ALIGN = "align"


@dataclass(frozen=True)
class StepRequest:
    """One request's share of a forward step: tokens ``[start, end)`` of ``prompt_len``."""

    request_id: str
    prompt_len: int
    start: int
    end: int
    p_blocks: tuple[np.ndarray, ...]  # manager block ids per group, prefill side
    d_blocks: tuple[np.ndarray, ...]  # manager block ids per group, decode side
    mamba_mode: MambaMode = MambaMode.NONE
    num_spec: int = 0

    @property
    def last(self) -> bool:
        return self.end >= self.prompt_len


@dataclass
class Descriptors:
    src: np.ndarray
    dst: np.ndarray
    length: np.ndarray

    @property
    def count(self) -> int:
        return int(self.src.size)

    @property
    def nbytes(self) -> int:
        return int(self.length.sum())

    @classmethod
    def concat(cls, parts: Sequence[Descriptors]) -> Descriptors:
        if not parts:
            e = np.empty(0, np.int64)
            return cls(e, e.copy(), e.copy())
        return cls(
            *(np.concatenate([getattr(p, f) for p in parts]) for f in ("src", "dst", "length"))
        )

    def coalesced(self) -> Descriptors:
        return Descriptors(*coalesce(self.src, self.dst, self.length))


@dataclass
class LayerPlan:
    """One layer of one step: descriptors per D rank, and requests dropped with the reason."""

    layer: int
    group: int
    per_peer: dict[int, Descriptors] = field(default_factory=dict)
    blocks: dict[int, int] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    req_bytes: dict[tuple[str, int], int] = field(default_factory=dict)  # (request, D rank)

    @property
    def descriptors(self) -> int:
        return sum(d.count for d in self.per_peer.values())

    @property
    def nbytes(self) -> int:
        return sum(d.nbytes for d in self.per_peer.values())


def check_gate(p: LayoutDesc, d: LayoutDesc) -> None:
    """The validation gate of DESIGN §5: same model, matching groups and regions."""
    if p.compat_hash != d.compat_hash:
        raise LayoutMismatchError(
            f"different models: prefill compat hash {p.compat_hash}, decode {d.compat_hash}; "
            "both sides must run the same preset, dtype and vLLM formulas"
        )
    if len(p.groups) != len(d.groups):
        raise LayoutMismatchError(
            f"prefill has {len(p.groups)} KV cache groups, decode {len(d.groups)}"
        )
    for gp, gd in zip(p.groups, d.groups, strict=True):
        if gp.kind != gd.kind or gp.layers != gd.layers:
            raise LayoutMismatchError(
                f"group {gp.index}: prefill {gp.kind} layers {gp.layers}, "
                f"decode {gd.kind} layers {gd.layers}"
            )
        if gp.kind is not SpecKind.MAMBA and gp.kernel_block_size != gd.kernel_block_size:
            raise LayoutMismatchError(
                f"group {gp.index}: kernel block sizes differ ({gp.kernel_block_size} vs "
                f"{gd.kernel_block_size}); set the same attention backend block size on both"
            )
    kinds_p = sorted((r.group, r.kind) for r in p.regions)
    kinds_d = sorted((r.group, r.kind) for r in d.regions)
    if len(kinds_p) != len(kinds_d) or {k for _, k in kinds_p} != {k for _, k in kinds_d}:
        raise LayoutMismatchError(
            f"regions differ in count or kind: prefill {len(kinds_p)}, decode {len(kinds_d)}"
        )
    for pp in p.placements:
        dp = d.placement(pp.layer)
        kind = _kind(p, pp.group)
        for a, b in zip(pp.pieces, dp.pieces, strict=True):
            la, lb = a.unit_count * a.unit_bytes, b.unit_count * b.unit_bytes
            if kind is RegionKind.REPLICATE and la != lb:
                raise LayoutMismatchError(
                    f"layer {pp.layer} {a.name}: replicated lengths differ ({la} vs {lb})"
                )
            if kind is not RegionKind.REPLICATE and lb * a.unit_count != la * b.unit_count:
                raise LayoutMismatchError(
                    f"layer {pp.layer} {a.name}: {la} B for {a.unit_count} heads on prefill and "
                    f"{lb} B for {b.unit_count} on decode do not match per head"
                )


def _kind(desc: LayoutDesc, group: int) -> RegionKind:
    kinds = {r.kind for r in desc.regions if r.group == group}
    return kinds.pop() if len(kinds) == 1 else RegionKind.SPLIT


def check_block_ids(desc: LayoutDesc, blocks: Sequence[np.ndarray], side: str) -> None:
    """Every block id of a request inside ``[0, num_blocks)`` (DESIGN §5)."""
    if len(blocks) != len(desc.groups):
        raise OutOfBoundsError(
            f"{side} sent block ids for {len(blocks)} groups, the layout has {len(desc.groups)}"
        )
    for g, ids in zip(desc.groups, blocks, strict=True):
        if ids.size and (ids.min() < 0 or ids.max() >= desc.num_blocks):
            bad = ids[(ids < 0) | (ids >= desc.num_blocks)]
            raise OutOfBoundsError(
                f"{side} block ids {bad[:4].tolist()} of group {g.index} are outside "
                f"[0, {desc.num_blocks})"
            )


def _state_index(ids: np.ndarray, req: StepRequest) -> int:
    if req.mamba_mode is MambaMode.NONE:
        return 0
    return int(ids.size) - 1 - req.num_spec


@dataclass
class _Batch:
    """Every kernel block one step sends to one D rank, flat over the step's requests."""

    n: np.ndarray  # kernel blocks per request (0 for requests sending nothing)
    req: np.ndarray  # request index of each kernel block
    p_ids: np.ndarray  # manager block id, prefill side
    p_kernel: np.ndarray  # kernel block inside it
    d_ids: np.ndarray
    d_kernel: np.ndarray


class PairPlanner:
    """Plans what one P rank writes to every D rank of one decode instance."""

    def __init__(self, local: LayoutDesc, remotes: Mapping[int, LayoutDesc]) -> None:
        self.local = local
        self.remotes = dict(remotes)
        for d in self.remotes.values():
            check_gate(local, d)
        self._templates: dict[tuple[int, int], Template] = {}
        self._bounds = {rank: _region_bounds(d) for rank, d in self.remotes.items()}
        self._local_bounds = _region_bounds(local)

    def template(self, layer: int, d_rank: int) -> Template:
        key = (layer, d_rank)
        t = self._templates.get(key)
        if t is None:
            pp = self.local.placement(layer)
            d = self.remotes[d_rank]
            t = layer_template(
                _kind(self.local, pp.group),
                pp.pieces,
                d.placement(layer).pieces,
                self.local.rank,
                self.local.tp,
                d_rank,
                d.tp,
            )
            self._templates[key] = t
        return t

    def peers(self) -> list[int]:
        """D ranks this P rank writes anything to."""
        return [
            r
            for r in sorted(self.remotes)
            if any(self.template(pl.layer, r)[0].size for pl in self.local.placements)
        ]

    def _select(
        self, requests: Sequence[StepRequest], group: int, d_rank: int
    ) -> tuple[_Batch, dict[str, str]]:
        """The kernel blocks of ``group`` every request sends to ``d_rank`` in this step, as flat
        arrays (no per-request numpy work: a step may hold hundreds of requests), and the
        requests that cannot be planned with the reason."""
        g = self.local.groups[group]
        gd = self.remotes[d_rank].groups[group]
        errors: dict[str, str] = {}
        count = len(requests)
        if g.kind is SpecKind.MAMBA:
            # Only the final state, one block per request that ends in this step.
            n = np.zeros(count, np.int64)
            picks: list[tuple[int, int, int]] = []
            for i, req in enumerate(requests):
                if not req.last:
                    continue
                p_ids, d_ids = req.p_blocks[group], req.d_blocks[group]
                ip, idd = _state_index(p_ids, req), _state_index(d_ids, req)
                if not (0 <= ip < p_ids.size and 0 <= idd < d_ids.size):
                    errors[req.request_id] = (
                        f"request {req.request_id}: no state block at index {ip}/{idd} "
                        f"(prefill has {p_ids.size} ids, decode {d_ids.size})"
                    )
                    continue
                n[i] = 1
                picks.append((i, int(p_ids[ip]), int(d_ids[idd])))
            arr = np.array(picks, np.int64).reshape(-1, 3)
            zero = np.zeros(len(picks), np.int64)
            return _Batch(n, arr[:, 0], arr[:, 1], zero, arr[:, 2], zero.copy()), errors

        def ints(values: Iterable[int]) -> np.ndarray:
            return np.fromiter(values, np.int64, count)

        start = ints(r.start for r in requests)
        end = ints(r.end for r in requests)
        prompt = ints(r.prompt_len for r in requests)
        p_sizes = ints(r.p_blocks[group].size for r in requests)
        d_sizes = ints(r.d_blocks[group].size for r in requests)
        # Token-order kernel blocks [lo, hi) per request. Decode reads tokens [0, prompt - 1)
        # and computes the last one itself, so it allocates blocks for prompt - 1 tokens only:
        # the block holding the last token goes only when it also holds an earlier one.
        kb = g.kernel_block_size
        lo = start // kb
        hi = np.where(end >= prompt, -(-np.minimum(end, prompt - 1) // kb), end // kb)
        if g.kind is SpecKind.SLIDING and g.sliding_window:
            bs_d = gd.block_size
            # Decode's last prompt token attends from token prompt - window on; vLLM gives
            # decode the null block for every block before that one.
            first = np.maximum(0, prompt - g.sliding_window) // bs_d
            lo = np.maximum(lo, first * bs_d // kb)
        n = np.maximum(hi - lo, 0)
        need_p, need_d = -(-hi // g.ratio), -(-hi // gd.ratio)
        short = (n > 0) & ((p_sizes < need_p) | (d_sizes < need_d))
        n[short] = 0
        owner = np.repeat(np.arange(count), n)
        j = np.arange(owner.size) + np.repeat(lo - (np.cumsum(n) - n), n)
        flat_p = np.concatenate([r.p_blocks[group] for r in requests] or [np.empty(0, np.int64)])
        flat_d = np.concatenate([r.d_blocks[group] for r in requests] or [np.empty(0, np.int64)])
        p_ids = flat_p[(np.cumsum(p_sizes) - p_sizes)[owner] + j // g.ratio]
        d_ids = flat_d[(np.cumsum(d_sizes) - d_sizes)[owner] + j // gd.ratio]
        null = self.remotes[d_rank].null_block
        hit = d_ids == null
        nulled = np.zeros(count, bool)
        if hit.any():
            nulled[owner[hit]] = True
        for i in np.flatnonzero(short | nulled).tolist():
            r = requests[i]
            if short[i]:
                errors[r.request_id] = (
                    f"request {r.request_id} group {group}: {r.end} tokens need "
                    f"{need_p[i]} prefill and {need_d[i]} decode blocks, got {p_sizes[i]} and "
                    f"{d_sizes[i]}"
                )
            else:
                errors[r.request_id] = (
                    f"request {r.request_id} group {group}: decode maps a needed block to the "
                    f"null block {null}"
                )
        batch = _Batch(n, owner, p_ids, j % g.ratio, d_ids, j % gd.ratio)
        return (_drop(batch, nulled) if nulled.any() else batch), errors

    def plan_layer(self, layer: int, requests: Sequence[StepRequest]) -> LayerPlan:
        """Descriptors per D rank for one layer of one step.

        A request whose blocks cannot be planned is left out for every peer and named in
        ``failed``, so nothing of it is written.
        """
        pl = self.local.placement(layer)
        plan = LayerPlan(layer, pl.group)
        chosen: list[tuple[int, LayerPlacement, Template, _Batch]] = []
        for d_rank, d in self.remotes.items():
            tmpl = self.template(layer, d_rank)
            if tmpl[0].size == 0:
                continue
            batch, errors = self._select(requests, pl.group, d_rank)
            for rid, err in errors.items():
                plan.failed.setdefault(rid, err)
            chosen.append((d_rank, d.placement(layer), tmpl, batch))
        failed = np.array([r.request_id in plan.failed for r in requests], bool)
        parts: dict[int, list[Descriptors]] = {}
        for d_rank, dl, tmpl, batch in chosen:
            if failed.any():
                batch = _drop(batch, failed)
            if batch.req.size == 0:
                continue
            src_b = pl.base + batch.p_ids * pl.block_stride + batch.p_kernel * pl.kernel_stride
            dst_b = dl.base + batch.d_ids * dl.block_stride + batch.d_kernel * dl.kernel_stride
            plan.blocks[d_rank] = plan.blocks.get(d_rank, 0) + int(batch.req.size)
            sending = np.flatnonzero(batch.n)
            per_req = (batch.n[sending] * int(tmpl[2].sum())).tolist()
            got = plan.req_bytes
            for i, nbytes in zip(sending.tolist(), per_req, strict=True):
                key = (requests[i].request_id, d_rank)
                got[key] = got.get(key, 0) + nbytes
            parts.setdefault(d_rank, []).append(
                Descriptors(
                    (src_b[:, None] + tmpl[0][None, :]).ravel(),
                    (dst_b[:, None] + tmpl[1][None, :]).ravel(),
                    np.broadcast_to(tmpl[2], (src_b.size, tmpl[2].size)).ravel(),
                )
            )
        for d_rank, ps in parts.items():
            descs = Descriptors.concat(ps).coalesced()
            self._bound_check(d_rank, descs)
            plan.per_peer[d_rank] = descs
        return plan

    def merge(self, plans: Sequence[LayerPlan]) -> tuple[Descriptors, list[int]]:
        """Several layers' plans as one submission, runs merged across layers (in a
        cross-layer layout one descriptor covers a block of every layer), never across two
        D ranks or two regions; and how many merged descriptors each plan is charged with."""
        out: list[Descriptors] = []
        charged = np.zeros(len(plans), np.int64)
        for d_rank in sorted({r for p in plans for r in p.per_peer}):
            parts = [(i, p.per_peer[d_rank]) for i, p in enumerate(plans) if d_rank in p.per_peer]
            descs = Descriptors.concat([d for _, d in parts])
            owner = np.repeat([i for i, _ in parts], [d.count for _, d in parts])
            src_k = _region_key(descs.src, self._local_bounds[0])
            dst_k = _region_key(descs.dst, self._bounds[d_rank][0])
            order = np.argsort(src_k, kind="stable")
            src_k, dst_k, ln = src_k[order], dst_k[order], descs.length[order]
            brk = np.ones(ln.size, dtype=bool)
            brk[1:] = (src_k[1:] != src_k[:-1] + ln[:-1]) | (dst_k[1:] != dst_k[:-1] + ln[:-1])
            idx = np.flatnonzero(brk)
            out.append(
                Descriptors(descs.src[order][idx], descs.dst[order][idx], np.add.reduceat(ln, idx))
            )
            charged += np.bincount(owner[order][idx], minlength=len(plans))
        return Descriptors.concat(out), charged.tolist()

    def _bound_check(self, d_rank: int, descs: Descriptors) -> None:
        lo, hi = self._bounds[d_rank]
        i = np.searchsorted(lo, descs.dst, side="right") - 1
        ok = (i >= 0) & (descs.dst + descs.length <= hi[np.maximum(i, 0)])
        if not ok.all():
            bad = int(np.flatnonzero(~ok)[0])
            raise OutOfBoundsError(
                f"descriptor to 0x{int(descs.dst[bad]):x}+{int(descs.length[bad])} on decode rank "
                f"{d_rank} leaves its registered regions"
            )


def _drop(batch: _Batch, bad: np.ndarray) -> _Batch:
    """``batch`` without the kernel blocks of requests flagged in ``bad``."""
    keep = ~bad[batch.req]
    return _Batch(
        np.where(bad, 0, batch.n),
        batch.req[keep],
        batch.p_ids[keep],
        batch.p_kernel[keep],
        batch.d_ids[keep],
        batch.d_kernel[keep],
    )


def _region_key(addr: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """``addr`` with its region's index above every address bit, so no run crosses regions."""
    return addr + ((np.searchsorted(starts, addr, side="right") - 1) << 48)


def _region_bounds(d: LayoutDesc) -> tuple[np.ndarray, np.ndarray]:
    spans = sorted({(r.base, r.base + r.length) for r in d.regions})
    return (np.array([s[0] for s in spans], np.int64), np.array([s[1] for s in spans], np.int64))
