"""A ``bench pd`` run (or a harness completion) that cannot finish in its wait says why in one
line: against a real HTTP server that answers too late, and through the run's exit path."""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from app.bench.core.systems import System
from app.bench.core.trial import run_trial
from app.bench.pd import bench as pd_bench
from app.errors import BenchError, ConfigError, DeadlineExceeded
from app.harness.local_pd import LocalPD
from app.harness.waits import PrefillClock, WaitPolicy

SHORT = WaitPolicy(slack=2.0, floor_s=0.5, step_s=0.0)


@pytest.fixture
def slow_engine() -> Iterator[str]:
    """An HTTP server whose ``/metrics`` answers at once and whose completions take 30 s."""
    stop = threading.Event()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.end_headers()

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["content-length"]))
            stop.wait(30)
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    stop.set()
    server.shutdown()
    server.server_close()


def _pd(tmp_path: Path, seconds_per_1k: float) -> LocalPD:
    clock = PrefillClock(SHORT)
    clock.observe(1000, seconds_per_1k)
    return LocalPD(tmp_path / "model", tmp_path / "work", clock=clock)


def test_a_completion_waits_for_its_prompts_length_then_says_why(
    tmp_path: Path, slow_engine: str
) -> None:
    pd = _pd(tmp_path, 0.25)
    t0 = time.monotonic()
    with pytest.raises(DeadlineExceeded) as e:
        pd.complete(slow_engine, [1] * 2000, 1)  # bound 0.25 * 2² = 1 s, x2 slack
    waited = time.monotonic() - t0
    assert 1.8 < waited < 5
    msg = str(e.value)
    assert "\n" not in msg
    assert "a 2000-token prompt" in msg and "no answer within 2 s" in msg
    assert "a 1000-token prefill measured in 0.2 s" in msg


def test_a_trial_waits_for_its_workload_then_says_why(tmp_path: Path, slow_engine: str) -> None:
    pd = _pd(tmp_path, 0.1)
    pd.prefill.vllm_port = int(slow_engine.rsplit(":", 1)[1])  # P's /metrics
    system = System("kv-sidecar", pd, front=slow_engine, _cpu_pids=[])
    t0 = time.monotonic()
    with pytest.raises(DeadlineExceeded) as e:
        # 2 prompts, each prefilled twice at most: 2 x slack x 4 x 0.1 s x 2²
        run_trial(system, [[1] * 1999, [2] * 1999], [{}, {}], 4)
    assert 3.0 < time.monotonic() - t0 < 8
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith("kv-sidecar: 2 x 1999-token prompt(s) did not finish within 3 s")
    assert "no answer" in msg and str(pd.work) in msg


@pytest.mark.parametrize(
    ("error", "line"),
    [
        (
            DeadlineExceeded("kv-sidecar: 1 x 65536-token prompt(s) did not finish"),
            "kv-sidecar: 1 x 65536-token prompt(s) did not finish",
        ),
        (
            ConfigError("vllm-prefill exited with 1:\nTraceback ...\n  File x\nValueError: boom"),
            "vllm-prefill exited with 1: ... ValueError: boom",
        ),
        (httpx.ReadTimeout("timed out"), "ReadTimeout: timed out"),
    ],
)
def test_a_run_that_fails_writes_one_line_and_exits_2(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    error: Exception,
    line: str,
) -> None:
    def run(_: pd_bench.PDOptions) -> None:
        raise error

    monkeypatch.setattr(pd_bench, "run", run)
    monkeypatch.setattr(pd_bench, "exit_on_signal", lambda: None)
    options = tmp_path / "options.json"
    options.write_text(
        json.dumps({"workloads": [{"tokens": 512, "concurrency": 1}], "out": str(tmp_path)})
    )
    with pytest.raises(SystemExit) as e:
        pd_bench.main([str(options)])
    assert e.value.code == 2
    assert (tmp_path / pd_bench.FAILURE).read_text() == line + "\n"
    assert capsys.readouterr().err == f"bench pd did not finish: {line}\n"


def test_a_prompt_longer_than_the_model_is_refused_at_start() -> None:
    opts = pd_bench.PDOptions(workloads=(pd_bench.Workload(131072),))
    with pytest.raises(ConfigError, match="needs 131152 positions; the bench model has 131072"):
        pd_bench.check_fits(opts)
    assert pd_bench.check_fits(pd_bench.PDOptions(workloads=(pd_bench.Workload(65536),))) == 65616


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None,
    reason="creates a network namespace: needs root and iproute2",
)
def test_the_command_says_why_the_run_did_not_finish(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from app.bench.pd import netns as pd_netns

    child = (
        "import sys, json, pathlib; out = pathlib.Path(json.load(open(sys.argv[1]))['out']);"
        f" (out / '{pd_bench.FAILURE}').write_text('kv-sidecar: too slow\\n'); sys.exit(2)"
    )
    monkeypatch.setattr(pd_netns, "CHILD", ("-c", child))
    with pytest.raises(BenchError) as e:
        pd_netns.run_in_namespace(pd_bench.PDOptions(out=str(tmp_path)))
    assert str(e.value) == f"the run did not finish: kv-sidecar: too slow (logs in {tmp_path}/work)"
