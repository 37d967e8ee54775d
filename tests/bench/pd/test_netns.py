"""``bench pd``'s namespace goes away when the run is interrupted (no engines: a sleeping child)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None,
    reason="creates a network namespace: needs root and iproute2",
)

SCRIPT = """
import sys
from app.bench.pd import netns as pd_netns
from app.bench.pd.bench import PDOptions
pd_netns.CHILD = ("-c", "import time, sys; print('child up', flush=True); time.sleep(120)")
pd_netns.run_in_namespace(PDOptions(out=sys.argv[1]))
"""


def _namespaces() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_interrupted_run_removes_its_namespace(tmp_path: Path, sig: int) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", SCRIPT, str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    ns = f"kvsbench-{proc.pid}"
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "child up"  # the child runs inside it
    assert ns in _namespaces()
    proc.send_signal(sig)
    proc.wait(60)
    assert proc.returncode != 0
    deadline = time.monotonic() + 10
    while ns in _namespaces() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ns not in _namespaces()


CLEANUP = """
import sys, time
from pathlib import Path
from app.bench.core.stop_signals import exit_on_signal
exit_on_signal()
try:
    print("up", flush=True)
    time.sleep(60)
finally:
    print("stopping engines", flush=True)
    time.sleep(1.0)  # a second signal lands here
    Path(sys.argv[1]).write_text("stopped")
"""


def test_a_second_signal_does_not_cut_the_runs_cleanup_short(tmp_path: Path) -> None:
    """Ctrl-C reaches the run, then ``run_child`` sends it SIGTERM while it stops its engines:
    raising there would leave them running (measured: three vLLM servers, 5 GB)."""
    done = tmp_path / "done"
    proc = subprocess.Popen(
        [sys.executable, "-c", CLEANUP, str(done)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "up"
    proc.send_signal(signal.SIGINT)
    assert proc.stdout.readline().strip() == "stopping engines"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 128 + signal.SIGINT
    assert done.read_text() == "stopped"
