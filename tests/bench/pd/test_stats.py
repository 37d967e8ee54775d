"""``bench pd``'s own pure logic (``pd.stats``): workloads, order rotation, the per-metric
summary with its paired ratios and A/A."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

from app.bench.pd.stats import (
    METRICS,
    Workload,
    paired_ratios,
    parse_workloads,
    summarize,
    trial_order,
)
from app.errors import ConfigError

A, B = "kv-sidecar", "mooncake"


def _trial(
    system: str, workload: str, counted: bool = True, rep: int = 0, **m: float
) -> dict[str, Any]:
    base = dict.fromkeys(METRICS, 1.0)
    return {
        "link": "unshaped",
        "workload": workload,
        "system": system,
        "rep": rep,
        "concurrency": 4 if "x" in workload else 1,
        "counted": counted,
        **base,
        **m,
    }


def test_workloads_parse_sizes_and_concurrency() -> None:
    ws = parse_workloads("512,2k,8K", "4x2k")
    assert ws == (Workload(512), Workload(2048), Workload(8192), Workload(2048, 4))
    assert [w.name for w in ws] == ["512", "2k", "8k", "4x2k"]
    assert parse_workloads("", "2x512") == (Workload(512, 2),)
    for bad in (("", ""), ("abc", ""), ("512", "4y2k"), ("512", "0x2k")):
        with pytest.raises(ConfigError):
            parse_workloads(*bad)


def test_systems_alternate_and_the_first_rotates() -> None:
    ws = (Workload(512), Workload(2048))
    order = trial_order(ws, (A, B), reps=4)
    assert len(order) == 4 * 2 * 2
    # Trial by trial the systems alternate within a workload...
    for i in range(0, len(order), 2):
        assert {order[i].system, order[i + 1].system} == {A, B}
        assert order[i].workload == order[i + 1].workload
    # ...and who goes first rotates with the repetition and the workload.
    firsts = [(t.rep, t.workload.name, t.system) for t in order[::2]]
    assert firsts[:4] == [(0, "512", A), (0, "2k", B), (1, "512", B), (1, "2k", A)]
    per = Counter((t.workload, t.system) for t in order[::2])
    assert set(per.values()) == {2}  # each system first equally often per workload


def test_summary_medians_ratios_and_uncounted_trials() -> None:
    trials = [
        _trial(A, "512", rep=0, ttft_ms=10),
        _trial(A, "512", rep=1, ttft_ms=30),
        _trial(A, "512", rep=2, ttft_ms=20),
        _trial(A, "512", rep=3, counted=False, ttft_ms=1000),
        _trial(B, "512", rep=0, ttft_ms=40),
        _trial(B, "512", rep=1, ttft_ms=float("nan")),  # not observed: not a value
    ]
    for t in trials:
        t["exposed_ms"] = -5.0 if t["system"] == A else 10.0
    rows = {r["metric"]: r for r in summarize(trials, (A, B))}
    assert rows["ttft_ms"][A] == 20 and rows["ttft_ms"][B] == 40
    assert rows["ttft_ms"]["ratio"] == pytest.approx(0.5)
    assert rows["ttft_ms"][f"{A}_n"] == 3 and rows["ttft_ms"][f"{B}_n"] == 2
    assert set(rows) == set(METRICS)
    # KV at D before P's answer (negative) has a median but no ratio.
    assert rows["exposed_ms"][A] == -5.0 and rows["exposed_ms"]["ratio"] is None
    # Every figure comes with its spread and n.
    assert rows["ttft_ms"]["spread"][A] == {"min": 10, "median": 20, "max": 30, "n": 3}
    assert rows["ttft_ms"]["spread"][B] == {"min": 40, "median": 40, "max": 40, "n": 1}
    # The ratio's own spread: per repetition where both counted (rep 0 only: B's rep 1 is NaN).
    assert rows["ttft_ms"]["ratio_spread"] == {"min": 0.25, "median": 0.25, "max": 0.25, "n": 1}
    assert rows["ttft_ms"]["aa"] is None


def test_aa_ratio_is_one_system_against_its_second_pass() -> None:
    A2 = f"{A}-aa"
    trials = []
    for rep, (a, a2, b) in enumerate([(100, 110, 200), (120, 100, 220), (90, 90, 180)]):
        trials += [
            _trial(A, "2k", rep=rep, ttft_ms=a),
            _trial(A2, "2k", rep=rep, ttft_ms=a2),
            _trial(B, "2k", rep=rep, ttft_ms=b),
        ]
    rows = {r["metric"]: r for r in summarize(trials, (A, B), aa=(A, A2))}
    row = rows["ttft_ms"]
    assert row["ratio"] == pytest.approx(100 / 200)
    assert row["spread"][A2] == {"min": 90, "median": 100, "max": 110, "n": 3}
    assert row["aa"]["systems"] == [A, A2]
    assert row["aa"]["ratio"] == pytest.approx(1.0)
    ratios = sorted([100 / 110, 120 / 100, 1.0])
    assert row["aa"]["ratio_spread"]["min"] == pytest.approx(ratios[0])
    assert row["aa"]["ratio_spread"]["max"] == pytest.approx(ratios[-1])
    assert row["aa"]["ratio_spread"]["n"] == 3
    # Paired by repetition, skipping uncounted trials and non-positive values.
    trials[0]["counted"] = False
    trials[5]["ttft_ms"] = -1.0  # rep 1, B
    assert paired_ratios(trials, A, B, "ttft_ms") == [pytest.approx(90 / 180)]


def test_every_ratio_has_a_paired_bootstrap_interval() -> None:
    A2 = f"{A}-aa"
    trials = []
    for rep in range(8):
        trials += [
            _trial(A, "2k", rep=rep, ttft_ms=100 + 5 * rep),
            _trial(A2, "2k", rep=rep, ttft_ms=100 + 5 * ((rep * 3) % 8)),
            _trial(B, "2k", rep=rep, ttft_ms=200 + 10 * rep),
        ]
    row = {r["metric"]: r for r in summarize(trials, (A, B), aa=(A, A2))}["ttft_ms"]
    iv = row["ratio_interval"]
    # A is half of B in every repetition: every resample's ratio of medians is 0.5.
    assert iv["point"] == pytest.approx(row["ratio"]) == pytest.approx(0.5)
    assert iv["low"] == pytest.approx(0.5) and iv["high"] == pytest.approx(0.5)
    assert (iv["units"], iv["level"]) == (8, 0.9)
    aa = row["aa"]["ratio_interval"]
    assert aa["point"] == pytest.approx(row["aa"]["ratio"])
    assert aa["low"] < 1.0 < aa["high"]  # A against itself in another order: spans 1
