"""Run a bench (``bench pd``, ``bench load``, ``bench soak``) inside a network namespace of its
own, and remove it however the run ends; ``child_main`` is the run's side of it.

Everything (engines, sidecars, proxies, taps, Mooncake, the client) runs in
``kvsbench-<pid>``, on its loopback only, so shaping that loopback (``tc ... tbf``) shapes
every byte between P and D and nothing else on the host. The namespace is removed at exit,
after Ctrl-C and SIGTERM too (handlers + ``finally``).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any, Protocol, TextIO, TypeVar

from app.bench.core.cores import binding
from app.bench.core.host import HostRecord
from app.bench.core.result_file import write_result
from app.bench.core.stop_signals import exit_on_signal
from app.errors import BenchError, ConfigError

FAILURE = "failure.txt"  # why a run did not finish, one line (run_child reads it)


class ChildOptions(Protocol):
    @property
    def out(self) -> str: ...


Opts = TypeVar("Opts", bound=ChildOptions)


def _ip(*args: str) -> None:
    r = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if r.returncode != 0:
        raise ConfigError(f"'ip {' '.join(args)}' failed: {r.stderr.strip()}")


def check_tools() -> None:
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise ConfigError(f"'{tool}' not found: install iproute2 (scripts/setup.sh does)")
    if os.geteuid() != 0:
        raise ConfigError(
            "bench pd creates a network namespace: run it as root (or with CAP_NET_ADMIN)"
        )


def run_child(
    child_args: tuple[str, ...],
    spec: dict[str, Any],
    out: Path,
    result: str,
    regime: str,
    stdout: TextIO | None = None,
) -> dict[str, Any]:
    """Run ``python CHILD_ARGS OPTIONS.json`` in a namespace of its own (with ``regime``'s
    binding; its output to ``stdout``, None: ours); the JSON it wrote to ``out/result``
    (``bench pd`` and ``bench load`` share it)."""
    check_tools()
    out.mkdir(parents=True, exist_ok=True)
    path = out / "options.json"
    path.write_text(json.dumps(spec))
    (out / result).unlink(missing_ok=True)
    (out / FAILURE).unlink(missing_ok=True)
    ns = f"kvsbench-{os.getpid()}"
    _ip("netns", "add", ns)
    child: subprocess.Popen[bytes] | None = None
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}

    def stop(signum: int, _frame: FrameType | None) -> None:
        # Let the run stop its engines first; the namespace goes in the finally below.
        if child is not None and child.poll() is None:
            child.send_signal(signal.SIGTERM)
        raise KeyboardInterrupt(f"signal {signum}")

    try:
        for s in previous:
            signal.signal(s, stop)
        _ip("netns", "exec", ns, "ip", "link", "set", "lo", "up")
        env = {**os.environ, "VLLM_HOST_IP": "127.0.0.1", "PYTHONUNBUFFERED": "1"}
        # The regime's binding (core.cores): every process of both systems inherits it.
        env |= binding(regime, os.sched_getaffinity(0)).env()
        child = subprocess.Popen(
            ["ip", "netns", "exec", ns, sys.executable, *child_args, str(path)],
            env=env,
            stdout=stdout,
        )
        rc = child.wait()
        if rc != 0:
            failure = out / FAILURE
            why = failure.read_text().strip() if failure.exists() else f"exit {rc}"
            raise BenchError(f"the run did not finish: {why} (logs in {out / 'work'})")
        return dict(json.loads((out / result).read_text()))
    finally:
        if child is not None and child.poll() is None:
            child.send_signal(signal.SIGTERM)
            try:
                child.wait(120)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
        for s, h in previous.items():
            signal.signal(s, h)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)


def child_main(
    argv: list[str] | None,
    options: Callable[[str], Opts],
    run: Callable[[Opts], tuple[dict[str, Any], HostRecord]],
    result: str,
) -> None:
    """What ``run_child`` starts: ``python -m BENCH OPTIONS.json`` reads its options, stops on
    SIGTERM too, runs and writes ``result`` (with the host record) to the options' ``out``."""
    args = sys.argv[1:] if argv is None else argv
    opts = options(Path(args[0]).read_text())
    exit_on_signal()
    figures, host = run(opts)
    write_result(Path(opts.out) / result, figures, host)
