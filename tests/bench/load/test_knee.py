"""``bench load``'s knee: the highest rate where at least 90% of requests met the SLO."""

from __future__ import annotations

from app.bench.load.stats import knee, knee_ratio, summarize_steps

A, B = "kv-sidecar", "mooncake"


def test_knee_is_the_highest_rate_meeting_the_slo_for_90_percent() -> None:
    table = [(0.5, 1.0), (1.0, 0.95), (2.0, 0.9), (3.0, 0.89), (4.0, 0.2)]
    assert knee(table) == 2.0  # 0.9 counts, 0.89 does not


def test_knee_takes_the_highest_passing_rate_even_after_a_dip() -> None:
    # Noise can dip one rung below 90%; the knee is still the highest passing rate.
    assert knee([(1.0, 0.95), (2.0, 0.85), (3.0, 0.92), (4.0, 0.1)]) == 3.0


def test_no_knee_when_no_rate_meets_the_slo() -> None:
    assert knee([(1.0, 0.5), (2.0, 0.2)]) is None
    assert knee([]) is None


def test_knee_ratio_divides_mine_by_the_peers_and_needs_both() -> None:
    assert knee_ratio(3.0, 2.0) == 1.5
    assert knee_ratio(None, 2.0) is None
    assert knee_ratio(3.0, None) is None


def _step(rate: float, system: str, attainment: float, rep: int = 0) -> dict[str, object]:
    return {"rate": rate, "system": system, "rep": rep, "attainment": attainment}


def test_summary_names_each_systems_knee_and_their_ratio() -> None:
    steps = [
        _step(1.0, A, 1.0),
        _step(2.0, A, 0.95),
        _step(4.0, A, 0.5),
        _step(1.0, B, 0.95),
        _step(2.0, B, 0.6),
        _step(4.0, B, 0.1),
    ]
    s = summarize_steps(steps, (A, B))
    assert s["knee"] == {A: 2.0, B: 1.0}
    assert s["knee_ratio"] == 2.0


def test_summary_knee_uses_the_median_attainment_over_reps() -> None:
    # At 2.0: A met 0.95, 0.5, 0.92 over three reps: median 0.92 passes.
    steps = [_step(1.0, A, 1.0), _step(1.0, B, 1.0)]
    steps += [_step(2.0, A, a, rep) for rep, a in enumerate((0.95, 0.5, 0.92))]
    steps += [_step(2.0, B, a, rep) for rep, a in enumerate((0.95, 0.5, 0.6))]
    s = summarize_steps(steps, (A, B))
    assert s["knee"] == {A: 2.0, B: 1.0}
    row = next(r for r in s["rows"] if r["rate"] == 2.0 and r["system"] == A)
    assert row["attainment"] == {"min": 0.5, "median": 0.92, "max": 0.95, "n": 3}
