"""A run whose engine's worker was killed says so, and by what, in its one line."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from app.bench.pd import bench as pd_bench
from app.bench.pd.engine_deaths import engine_deaths

# vLLM's own lines, as a 64k run's prefill engine wrote them when the host ran out of memory.
DIED = (
    "1796641772.000849 ERROR vllm.v1.executor.multiproc_executor: Worker proc VllmWorker-0 died "
    "unexpectedly (exit code: -9), shutting down executor.\n"
    "1796641772.005636 ERROR vllm.v1.engine.core: EngineCore encountered a fatal error.\n"
)
FINE = "1796641098.799916 INFO vllm.v1.metrics.loggers: Engine 000: Iteration(74): ...\n"


def _logs(work: Path) -> None:
    for system, role, text in (
        ("kv-sidecar", "prefill", FINE + DIED),
        ("kv-sidecar", "decode", FINE),
        ("mooncake", "decode", DIED.replace("-9", "1")),
    ):
        (work / system).mkdir(parents=True, exist_ok=True)
        (work / system / f"vllm-{role}.log").write_text(text)


def test_each_dead_worker_is_named_with_its_signal(tmp_path: Path) -> None:
    _logs(tmp_path)
    assert engine_deaths(tmp_path) == [
        "kv-sidecar/vllm-prefill: Worker proc VllmWorker-0 died unexpectedly (exit code: -9) "
        "(SIGKILL: the kernel's OOM killer, when the host ran out of memory)",
        "mooncake/vllm-decode: Worker proc VllmWorker-0 died unexpectedly (exit code: 1)",
    ]
    assert engine_deaths(tmp_path / "none") == []


def test_the_runs_line_names_the_dead_engine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _logs(tmp_path / "work")

    def run(_: pd_bench.PDOptions) -> None:
        request = httpx.Request("POST", "http://127.0.0.1:1/v1/completions")
        raise httpx.HTTPStatusError(
            "Server error '500 Internal Server Error'",
            request=request,
            response=httpx.Response(500, request=request),
        )

    monkeypatch.setattr(pd_bench, "run", run)
    monkeypatch.setattr(pd_bench, "exit_on_signal", lambda: None)
    options = tmp_path / "options.json"
    options.write_text(
        json.dumps({"workloads": [{"tokens": 512, "concurrency": 1}], "out": str(tmp_path)})
    )
    with pytest.raises(SystemExit):
        pd_bench.main([str(options)])
    line = (tmp_path / pd_bench.FAILURE).read_text()
    assert line.count("\n") == 1, line
    assert line.startswith("HTTPStatusError: Server error '500 Internal Server Error'; ")
    assert "kv-sidecar/vllm-prefill: Worker proc VllmWorker-0 died" in line
    assert "OOM killer" in line
