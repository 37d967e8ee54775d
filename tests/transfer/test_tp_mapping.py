"""TP mapping: every unit D holds arrives exactly once, from the rule's sender."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from app.kvcache.layout import Piece
from app.kvcache.specs import RegionKind, held_units
from app.transfer.planning.tp_mapping import first_holder, piece_template, replicate_sender

PAIRS = [(1, 1), (1, 2), (2, 1), (2, 4), (4, 2), (4, 1), (1, 4), (8, 2), (2, 8)]


def _piece(units: int, tp: int, rank: int, unit_bytes: int = 8) -> Piece:
    first, count = held_units(rank, tp, units)
    return Piece("k", 0, 1, 0, units, first, count, unit_bytes, unit_bytes)


@pytest.mark.parametrize(("p_tp", "d_tp"), PAIRS)
@pytest.mark.parametrize("units", [1, 2, 8])
def test_split_units_arrive_once(p_tp: int, d_tp: int, units: int) -> None:
    for d in range(d_tp):
        dp = _piece(units, d_tp, d)
        got = np.zeros(dp.unit_count, int)
        for p in range(p_tp):
            pp = _piece(units, p_tp, p)
            src, dst, ln = piece_template(RegionKind.SPLIT, pp, dp, p, p_tp, d, d_tp)
            for s, o, n in zip(src, dst, ln, strict=True):
                # The bytes come from the same global heads they land on.
                assert pp.unit_first + s // 8 == dp.unit_first + o // 8
                got[o // 8 : (o + n) // 8] += 1
                assert first_holder(pp.unit_first + s // 8, units, p_tp) == p
        assert got.tolist() == [1] * dp.unit_count


@pytest.mark.parametrize(("p_tp", "d_tp"), PAIRS)
def test_replicate_spreads_over_prefill_ranks(p_tp: int, d_tp: int) -> None:
    senders = [replicate_sender(d, p_tp, d_tp) for d in range(d_tp)]
    assert all(0 <= s < p_tp for s in senders)
    if p_tp >= d_tp:
        assert len(set(senders)) == d_tp  # each D rank served by a different P rank
    for d, p in itertools.product(range(d_tp), range(p_tp)):
        piece = Piece("latent", 0, 1, 0, 1, 0, 1, 64, 64)
        _src, _, ln = piece_template(RegionKind.REPLICATE, piece, piece, p, p_tp, d, d_tp)
        assert (ln.sum() == 64) == (p == senders[d])


def test_nhd_head_slices_are_one_descriptor_per_row() -> None:
    # 4 heads on P (TP 1) to D TP 2: two heads per token row, 16 rows.
    p = Piece("k", 0, 16, 4 * 8, 4, 0, 4, 8, 8)
    d = Piece("k", 0, 16, 2 * 8, 4, 2, 2, 8, 8)
    src, dst, ln = piece_template(RegionKind.SPLIT, p, d, 0, 1, 1, 2)
    assert src.size == 16 and set(ln.tolist()) == {16}
    assert src[:2].tolist() == [16, 48] and dst[:2].tolist() == [0, 16]
