"""``bench load``: ABBA rounds at each rate; which system opens alternates rate by rate."""

from __future__ import annotations

from app.bench.core.calibrate import calibration_lengths
from app.bench.core.workload import Lengths
from app.bench.load.bench import run_order, rung_order

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


def test_each_rate_runs_abba_rounds_opening_with_the_other_system_at_the_next() -> None:
    order = [(rung, b.system, b.round) for rung, b in run_order([A, B], 2, 2)]
    assert order == [
        (0, A, 0),
        (0, B, 0),
        (0, B, 1),
        (0, A, 1),
        (1, B, 0),
        (1, A, 0),
        (1, A, 1),
        (1, B, 1),
    ]
