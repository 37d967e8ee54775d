"""``bench pd``'s table and plot from a summary (no engines)."""

from __future__ import annotations

import io
import re
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from app.bench.core.cores import binding
from app.bench.pd.report import plot, print_summary
from app.bench.pd.stats import METRICS, summarize

A, B, A2 = "kv-sidecar", "mooncake", "kv-sidecar-aa"


def _result() -> dict[str, Any]:
    trials = []
    for rep in range(3):
        for system, ttft in ((A, 100 + rep), (B, 200 - rep), (A2, 101)):
            t: dict[str, Any] = dict.fromkeys(METRICS, 1.0)
            t |= {"link": "unshaped", "workload": "512", "system": system, "rep": rep}
            t |= {"counted": True, "ttft_ms": float(ttft), "bytes": 2.0**20}
            trials.append(t)
    return {
        "options": {"reps": 3},
        "aa": [A, A2],
        "binding": binding("dedicated", [0, 1]).as_dict(),
        "cpu_scope": {A: "the sidecars", B: "Mooncake's threads"},
        "links": [{"link": "unshaped"}],
        "summary": summarize(trials, (A, B), (A, A2)),
        "not_counted": [],
    }


def test_table_shows_spreads_ratio_and_noise_floor() -> None:
    out = io.StringIO()
    print_summary(_result(), Console(file=out, width=250))
    text = out.getvalue()
    assert "101.0 (100.0–102.0)" in text  # kv-sidecar's TTFT: median (min–max)
    assert "199.0 (198.0–200.0)" in text
    # Ratio of medians [its 90% interval] (per-repetition range); the A/A: the noise floor.
    assert re.search(r"0\.51 \[0\.5\d, 0\.5\d\] \(0\.50–0\.52\)", text), text
    assert re.search(r"1\.00 \[0\.99, 1\.01\] \(0\.99–1\.01\)", text), text
    assert "3/3/3" in text  # n per system
    assert "on core 1" in text and "Mooncake's threads" in text


def test_plot_draws_medians_with_ranges(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    path = plot(_result(), tmp_path / "pd.png")
    assert path.exists() and path.stat().st_size > 0
