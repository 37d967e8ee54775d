"""``bench load``: which system goes first alternates rate by rate (and pass by pass)."""

from __future__ import annotations

from app.bench.core.calibrate import calibration_lengths
from app.bench.core.workload import Lengths
from app.bench.load.bench import rung_order

A, B, AA = "kv-sidecar", "mooncake", "kv-sidecar-aa"


def test_first_system_alternates_by_rate() -> None:
    firsts = [rung_order([A, B], rung, 0)[0] for rung in range(4)]
    assert firsts == [A, B, A, B]


def test_a_second_pass_starts_the_other_way() -> None:
    assert rung_order([A, B], 0, 1) == [B, A]


def test_the_aa_pass_joins_the_rotation() -> None:
    assert rung_order([A, B, AA], 1, 0) == [B, AA, A]


def test_calibration_spans_short_median_and_long_prompts() -> None:
    assert calibration_lengths(Lengths()) == (128, 1024, 2855)
    assert calibration_lengths(Lengths(median=256, lo=64, hi=512)) == (64, 256, 512)
