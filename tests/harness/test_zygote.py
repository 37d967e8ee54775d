"""The harness's fork server: a child runs a module as ``python -m`` would, forked from the
interpreter that imported the heavy modules once (the point: vLLM's 15 s import, once)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from app.errors import ConfigError
from app.harness.zygote import ENV, UNKNOWN_EXIT, Zygote, ZygoteChild, start_process

CHILD = "tests.harness.zygote_child"


@pytest.fixture
def zygote(tmp_path: Path) -> Iterator[Zygote]:
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "WARNING"}
    z = Zygote(["tests.harness.zygote_preload"], env, tmp_path / "zygote.log")
    yield z
    z.close()


def said(log: Path) -> dict[str, object]:
    return dict(json.loads(log.read_text().splitlines()[0]))


def test_a_child_runs_the_module_as_main_with_its_own_argv_env_cwd_and_log(
    zygote: Zygote, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = tmp_path / "child.log"
    log.write_text("an earlier run's line\n")
    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)
    env = {**zygote.env, "ZYGOTE_TEST_VALUE": "mine"}
    child = zygote.spawn(CHILD, ["3", "--flag"], env, log, 10)
    assert child.wait(30) == 3 and child.returncode == 3 and child.poll() == 3
    out = said(log)
    assert out["argv"] == ["3", "--flag"] and out["name"] == "__main__"
    assert out["cwd"] == str(work) and out["env"] == "mine"
    assert log.read_text().splitlines()[-1] == "atexit ran"  # as an interpreter's exit runs them
    assert "earlier" not in log.read_text()


def test_the_child_is_forked_from_the_interpreter_that_imported_once(
    zygote: Zygote, tmp_path: Path
) -> None:
    """The speed: a module the zygote preloaded is not imported again in a child (a fresh
    interpreter would import it in itself)."""
    pids = []
    for i in range(2):
        log = tmp_path / f"child{i}.log"
        zygote.spawn(CHILD, ["0"], zygote.env, log, 10).wait(30)
        out = said(log)
        assert out["imported_in"] != out["pid"]
        pids.append(out["imported_in"])
    assert pids[0] == pids[1]


def test_a_killed_child_reports_its_signal_as_popen_does(zygote: Zygote, tmp_path: Path) -> None:
    log = tmp_path / "child.log"
    child = zygote.spawn(CHILD, ["sleep"], zygote.env, log, 10)
    assert child.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(0.5)
    child.send_signal(signal.SIGKILL)
    assert child.wait(30) == -signal.SIGKILL
    child.kill()  # reaped: nothing is signalled (its pid may be another process's by now)


class ExitNotYetRead:
    """A zygote that reaped a child but whose exit line the harness has not read yet."""

    def exit_code(self, pid: int) -> None:
        return None


def test_a_child_reaped_before_its_exit_was_read_takes_a_signal_quietly() -> None:
    """CI once lost this race: a cluster's close signalled a child the zygote had just
    reaped, and the ProcessLookupError left the rest of the cluster running."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # reaped: its pid names no process now
    child = ZygoteChild(ExitNotYetRead(), gone.pid)  # type: ignore[arg-type]
    child.send_signal(signal.SIGCONT)
    child.terminate()
    assert child.poll() is None  # the exit still comes from the zygote, not from the signal


def test_an_environment_vllm_reads_on_import_differently_is_refused(
    zygote: Zygote, tmp_path: Path
) -> None:
    env = {**zygote.env, "VLLM_LOGGING_LEVEL": "DEBUG"}
    assert not zygote.accepts(env)
    with pytest.raises(ConfigError, match=r"import-time settings.*'WARNING', 'DEBUG'"):
        zygote.spawn(CHILD, ["0"], env, tmp_path / "child.log", 10)


def test_a_child_outliving_a_dead_zygote_still_ends(zygote: Zygote, tmp_path: Path) -> None:
    """Its exit code is lost with the zygote, but a wait on it ends, with UNKNOWN_EXIT."""
    child = zygote.spawn(CHILD, ["sleep"], zygote.env, tmp_path / "child.log", 10)
    os.kill(zygote.pid, signal.SIGKILL)
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(1)
    os.kill(child.pid, signal.SIGKILL)
    assert child.wait(30) == UNKNOWN_EXIT


def test_engines_with_other_import_time_settings_get_a_zygote_of_their_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV, "1")
    base = {**os.environ, "VLLM_LOGGING_LEVEL": "WARNING"}
    cmd = [sys.executable, "-m", "app.sim.engine", "--help"]
    quiet = start_process(cmd, base, tmp_path / "a.log")
    again = start_process(cmd, base, tmp_path / "b.log")
    loud = start_process(cmd, {**base, "VLLM_LOGGING_LEVEL": "INFO"}, tmp_path / "c.log")
    assert all(isinstance(p, ZygoteChild) for p in (quiet, again, loud))
    assert [p.wait(60) for p in (quiet, again, loud)] == [0, 0, 0]
    assert "--sidecar" in (tmp_path / "c.log").read_text()  # the module's own --help
    assert quiet.zygote is again.zygote and loud.zygote is not quiet.zygote
    plain = start_process([sys.executable, "-m", "json.tool", "--help"], base, tmp_path / "d.log")
    assert isinstance(plain, subprocess.Popen) and plain.wait(60) == 0
