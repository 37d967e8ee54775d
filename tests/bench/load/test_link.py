"""``bench load --link``: the shaped rate from the unloaded run (a request's KV in a quarter of
P's prefill), a link left alone when not shaped, the report naming it, an unknown one refused."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console
from typer.testing import CliRunner

from app.bench.load.bench import LoadOptions, shape
from app.bench.load.report import print_summary
from app.bench.load.stats import link_calibration
from app.cli.main import app
from app.errors import ConfigError


def _row(system: str, tokens: int, kv: int, prefill_s: float, **kw: Any) -> dict[str, Any]:
    row = {"system": system, "prompt_tokens": tokens, "bytes": kv, "p_prefill_s": prefill_s}
    return row | {"error": None} | kw


def test_the_rate_moves_a_requests_kv_in_a_quarter_of_its_prefill() -> None:
    rows = [
        _row("kv-sidecar", 64, 1_000_000, 0.10),
        _row("mooncake", 64, 1_000_000, 0.30),  # median prefill of the length: 0.2 s
        _row("kv-sidecar", 1024, 16_000_000, 1.6),
        _row("mooncake", 1024, 16_000_000, 1.6),
        _row("mooncake", 256, 0, 0.5),  # nothing moved: not a point
        _row("kv-sidecar", 256, 9_000_000, 0.01, error="ReadTimeout"),  # failed: not a point
    ]
    cal = link_calibration(rows)
    assert set(cal["per_workload"]) == {"64", "1024"}
    # 8 Mbit in 0.05 s = 160 Mbit/s; 128 Mbit in 0.4 s = 320 Mbit/s; the median of the two.
    assert cal["per_workload"]["64"]["rate_bps"] == pytest.approx(160e6)
    assert cal["per_workload"]["1024"]["rate_bps"] == pytest.approx(320e6)
    assert cal["rate_bps"] == pytest.approx(240e6)


def test_an_unshaped_run_touches_no_link() -> None:
    # No tc call (it would run outside the namespace here): nothing measured, nothing set.
    assert shape(LoadOptions(), []) == ({"link": "unshaped"}, None)


def test_the_report_names_the_shaped_link_and_old_runs_stay_unshaped() -> None:
    docs = Path(__file__).parents[3] / "docs" / "bench"
    for name, shaped in (
        ("load-dedicated-shaped-avx512.json", True),
        ("load-dedicated-full-length-avx2.json", False),  # made before --link: no "link" key
    ):
        out = io.StringIO()
        print_summary(json.loads((docs / name).read_text()), Console(file=out, width=400))
        text = out.getvalue()
        assert ("rate steps on a shaped link (409 Mbit/s)" in text) is shaped, name
        assert "knee_ratio kv-sidecar / mooncake" in text


def test_an_unknown_link_is_refused_before_anything_starts() -> None:
    r = CliRunner().invoke(app, ["bench", "load", "--link", "both"])  # bench pd's, not load's
    assert isinstance(r.exception, ConfigError)
    assert "--link 'both': expected one of unshaped, shaped" in str(r.exception)
