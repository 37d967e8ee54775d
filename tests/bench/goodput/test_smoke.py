"""Smoke test: a tiny bench over the real engine returns every headline key with sane values."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from app.bench.goodput.report import plot, summarize
from app.bench.goodput.runner import BenchOptions, run_bench

KEYS = {
    "raw_gbps",
    "layerwise_gbps",
    "goodput_ratio",
    "exposed_ms",
    "bulk_exposed_ms",
    "overlap_ratio",
    "descriptors",
    "min_descriptors",
    "planning_fraction",
    "max_in_flight",
    "failures",
    "rss_growth",
    "goals",
}


@pytest.mark.timeout(600)  # four processes importing torch on a busy 2-core box
def test_tiny_bench_reports_every_key(tmp_path: Path) -> None:
    opts = BenchOptions(
        layers=2,
        requests=2,
        prompt_tokens=512,
        lengths=(512,),
        reps=1,
        overlap_reps=1,
        scale_requests=(1, 8),
        scale_tokens=256,
        scale_repeats=2,
        layouts=("per_layer",),
        points=(),
        raw_bytes=16 << 20,
        quick=True,
        log_dir=str(tmp_path / "logs"),
    )
    s = summarize(run_bench(opts))
    assert s.keys() >= KEYS
    json.dumps(s)  # JSON-able as printed by --json
    assert s["failures"] == 0, s["failures_detail"]
    assert s["raw_gbps"] > 0 and s["layerwise_gbps"] > 0 and s["goodput_ratio"] > 0
    assert s["exposed_ms"] >= 0 and s["bulk_exposed_ms"] > 0
    assert s["overlap_ratio"] is not None and s["overlap_ratio"] >= 0
    assert s["descriptors"] == s["min_descriptors"] > 0
    assert 0 <= s["planning_fraction"] < 10
    assert s["max_in_flight"] == 8
    assert abs(s["rss_growth"]) < 256  # MiB
    if importlib.util.find_spec("matplotlib") is not None:
        png = plot(s, tmp_path / "exposed.png")
        assert png.read_bytes()[:4] == b"\x89PNG"
