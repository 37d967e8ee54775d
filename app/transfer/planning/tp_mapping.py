"""TP mapping (DESIGN §3): what P rank p writes into D rank d, per layer, inside one kernel block.

Pure functions over ``Piece`` descriptions. Every sharded piece is a run of global units (KV
heads, Mamba heads, B/C groups); D rank d receives each unit it holds from the *first* P rank
holding it, so replicated heads are sent once and land in every D replica. REPLICATE pieces
(MLA latent, indexer) come whole from one P rank per D rank, spread over the P ranks.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from app.errors import LayoutMismatchError
from app.kvcache.layout import Piece
from app.kvcache.specs import RegionKind

Template = tuple[np.ndarray, np.ndarray, np.ndarray]  # src offset, dst offset, length (int64)

EMPTY: Template = (np.empty(0, np.int64), np.empty(0, np.int64), np.empty(0, np.int64))


def replicate_sender(d_rank: int, p_tp: int, d_tp: int) -> int:
    """The one P rank that writes a replicated region into D rank ``d_rank``."""
    if p_tp <= d_tp:
        return d_rank * p_tp // d_tp
    return d_rank * (p_tp // d_tp)


def first_holder(unit: int, units: int, tp: int) -> int:
    """The lowest rank of ``tp`` that holds global unit ``unit``."""
    if tp <= units:
        return unit // (units // tp)
    return unit * (tp // units)


def senders(
    kind: RegionKind, d_rank: int, d_first: int, d_count: int, units: int, p_tp: int, d_tp: int
) -> set[int]:
    """Every P rank that writes something of this piece into D rank ``d_rank``."""
    if kind is RegionKind.REPLICATE:
        return {replicate_sender(d_rank, p_tp, d_tp)}
    return {first_holder(u, units, p_tp) for u in range(d_first, d_first + d_count)}


def _check(p: Piece, d: Piece) -> None:
    if (p.units, p.unit_bytes, p.outer) != (d.units, d.unit_bytes, d.outer):
        raise LayoutMismatchError(
            f"piece {p.name!r}: prefill has {p.units} units of {p.unit_bytes} B x {p.outer} rows, "
            f"decode has {d.units} units of {d.unit_bytes} B x {d.outer} rows"
        )


def piece_template(
    kind: RegionKind, p: Piece, d: Piece, p_rank: int, p_tp: int, d_rank: int, d_tp: int
) -> Template:
    """Descriptors (relative to the two kernel-block addresses) P rank writes to D rank."""
    _check(p, d)
    if kind is RegionKind.REPLICATE:
        if replicate_sender(d_rank, p_tp, d_tp) != p_rank:
            return EMPTY
        lo, hi = 0, p.units
    else:
        lo = max(p.unit_first, d.unit_first)
        hi = min(p.unit_first + p.unit_count, d.unit_first + d.unit_count)
        if lo >= hi or first_holder(lo, p.units, p_tp) != p_rank:
            return EMPTY
        # A P rank that holds a unit but is not its first holder sends nothing of it.
        hi = min(hi, lo + p.unit_count)
    n_units = hi - lo
    if p.contiguous and d.contiguous:
        u = np.zeros(1, np.int64)
        length = n_units * p.unit_bytes
    else:
        u = np.arange(n_units, dtype=np.int64)
        length = p.unit_bytes
    o = np.arange(p.outer, dtype=np.int64)[:, None]
    src = p.offset + o * p.outer_stride + (lo - p.unit_first + u) * p.unit_stride
    dst = d.offset + o * d.outer_stride + (lo - d.unit_first + u) * d.unit_stride
    src, dst = src.ravel(), dst.ravel()
    return src, dst, np.full(src.shape, length, np.int64)


def layer_template(
    kind: RegionKind,
    p_pieces: Sequence[Piece],
    d_pieces: Sequence[Piece],
    p_rank: int,
    p_tp: int,
    d_rank: int,
    d_tp: int,
) -> Template:
    """All pieces of one layer, coalesced inside the block."""
    if [x.name for x in p_pieces] != [x.name for x in d_pieces]:
        raise LayoutMismatchError(
            f"layer streams differ: prefill {[x.name for x in p_pieces]}, "
            f"decode {[x.name for x in d_pieces]}"
        )
    parts = [
        piece_template(kind, p, d, p_rank, p_tp, d_rank, d_tp)
        for p, d in zip(p_pieces, d_pieces, strict=True)
    ]
    src = np.concatenate([t[0] for t in parts])
    dst = np.concatenate([t[1] for t in parts])
    ln = np.concatenate([t[2] for t in parts])
    return coalesce(src, dst, ln)


def coalesce(src: np.ndarray, dst: np.ndarray, ln: np.ndarray) -> Template:
    """Merge descriptors into maximal runs contiguous on both sides (sorted by source)."""
    if src.size == 0:
        return src, dst, ln
    order = np.argsort(src, kind="stable")
    src, dst, ln = src[order], dst[order], ln[order]
    brk = np.ones(src.size, dtype=bool)
    brk[1:] = (src[1:] != src[:-1] + ln[:-1]) | (dst[1:] != dst[:-1] + ln[:-1])
    idx = np.flatnonzero(brk)
    return src[idx], dst[idx], np.add.reduceat(ln, idx)
