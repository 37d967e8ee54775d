"""``app.bench.scaling.bench``: the curves' fits (pure), and a run at two short lengths on a real
sidecar pair with simulated engines (its JSON's shape, and costs that grow with the length)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from app.bench.scaling import bench as scaling
from app.bench.scaling.bench import CURVES, ScalingOptions, fits, growth, loglog_slope, parse_tokens
from app.errors import BenchError


def test_loglog_slope_reads_the_power() -> None:
    xs = [1024, 2048, 4096, 8192]
    assert loglog_slope(xs, [3 * x for x in xs]) == pytest.approx(1.0)
    assert loglog_slope(xs, [x * x / 7 for x in xs]) == pytest.approx(2.0)
    assert loglog_slope(xs, [5.0] * 4) == pytest.approx(0.0)
    assert loglog_slope(xs, [0.0, 0.0, 0.0, 1.0]) is None  # one positive point


@pytest.mark.parametrize(
    ("slope", "words"),
    [(0.02, "flat"), (0.5, "sublinear"), (0.97, "linear"), (1.9, "superlinear"), (None, "unknown")],
)
def test_growth_in_words(slope: float | None, words: str) -> None:
    assert growth(slope) == words


def test_fits_leave_out_the_lengths_fixed_costs_dominate() -> None:
    rows = [
        {"tokens": n, "descriptors": 100 + n // 64 if n < 4096 else n // 16}
        for n in (1024, 2048, 4096, 8192, 16384)
    ]
    fit = fits(rows, ["descriptors"])["descriptors"]
    assert fit == {"slope": 1.0, "growth": "linear", "from_tokens": 4096}


def test_parse_tokens() -> None:
    assert [parse_tokens(x) for x in ("1k", "128K", "4096")] == [1024, 131072, 4096]
    with pytest.raises(BenchError, match="expected tokens such as 4096 or 4k"):
        parse_tokens("4kb")


def test_a_run_at_two_lengths(tmp_path: Path) -> None:
    opts = ScalingOptions(lengths=(1024, 256), reps=1, compute_ms=1.0, fill=True)
    result = scaling.run(opts, progress=lambda _: None)
    scaling.write(result, tmp_path / "s.json")
    written = json.loads((tmp_path / "s.json").read_text())
    assert written == {**result, "host": written["host"]}
    assert result["options"]["lengths"] == [256, 1024]
    assert set(result["fits"]) == set(CURVES)
    assert written["host"]["cpu_model"] and written["host"]["commit"]
    short, long = result["rows"]
    assert short["tokens"] == 256 and long["tokens"] == 1024
    for row in (short, long):
        assert row["verified"] == 1  # every byte checked at D
        for key in CURVES:
            assert math.isfinite(row[key]) and row[key] >= 0, key
            assert row[key] > 0 or "added" in key, key
        assert row["min_descriptors"] <= row["descriptors"]
    assert long["descriptors"] > 2 * short["descriptors"]  # one a block run a layer: ~4x
    assert long["bytes"] == 4 * short["bytes"]
    assert short["rss_anon_added_mib_prefill"] == 0  # above the shortest length's own peak


def test_against_baseline_flags_what_grew_past_the_limit() -> None:
    before = [{"tokens": 1024, "cpu_s_per_gb": 1.0}, {"tokens": 4096, "cpu_s_per_gb": 0.5}]
    now = [
        {"tokens": 1024, "cpu_s_per_gb": 1.19},
        {"tokens": 4096, "cpu_s_per_gb": 0.61},
        {"tokens": 8192, "cpu_s_per_gb": 9.0},  # not in the baseline: not compared
    ]
    rows = scaling.against_baseline(before, now, 1.2)
    assert [(r["tokens"], r["ratio"], r["regressed"]) for r in rows] == [
        (1024, 1.19, False),
        (4096, 1.22, True),
    ]


def test_a_baseline_that_is_not_a_scaling_run_is_refused_before_the_run(tmp_path: Path) -> None:
    bad = tmp_path / "b.json"
    bad.write_text('{"rows": [{"tokens": 1024}]}')
    with pytest.raises(SystemExit) as e:
        scaling.main(["--lengths", "256", "--baseline", str(bad), "--out", str(tmp_path / "o")])
    assert e.value.code == 2
    assert not (tmp_path / "o").exists()


def test_a_run_against_a_baseline_exits_3_on_a_regression(tmp_path: Path) -> None:
    """One real run at 256 tokens against a baseline 1000x cheaper: a regression, exit 3, the
    comparison in the JSON."""
    base = tmp_path / "base.json"
    base.write_text(json.dumps({"rows": [{"tokens": 256, "cpu_s_per_gb": 1e-3}]}))
    out = tmp_path / "now.json"
    args = ["--lengths", "256", "--reps", "1", "--compute-ms", "1", "--out", str(out)]
    with pytest.raises(SystemExit) as e:
        scaling.main([*args, "--baseline", str(base)])
    assert e.value.code == 3
    (row,) = json.loads(out.read_text())["baseline"]["rows"]
    assert row["tokens"] == 256 and row["regressed"] and row["ratio"] > 1.2
