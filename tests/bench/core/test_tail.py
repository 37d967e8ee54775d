"""A tail figure is called P99 only over 100 samples and more; below, it is the max."""

from __future__ import annotations

from app.bench.core.slo import named_tail, percentile, tail, tail_label


def test_under_100_samples_the_tail_is_the_max() -> None:
    values = [float(v) for v in range(99)]
    assert tail_label(99) == "max"
    assert tail(values) == ("max", 98.0)


def test_from_100_samples_the_tail_is_the_p99() -> None:
    values = [float(v) for v in range(100)]
    assert tail_label(100) == "p99"
    label, v = tail(values)
    p99 = percentile(values, 99)
    assert label == "p99" and v == p99 and p99 is not None and p99 < max(values)


def test_no_sample_gives_no_tail() -> None:
    assert tail([]) == ("max", None)
    assert tail([float("nan")]) == ("max", None)  # a NaN is no sample


def test_a_result_without_a_p99_prints_its_max() -> None:
    assert named_tail(None, 7.0) == ("max", 7.0)
    assert named_tail(5.0, 7.0) == ("p99", 5.0)
