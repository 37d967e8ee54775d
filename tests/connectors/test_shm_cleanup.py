"""Killing a LocalPD process tree removes the /dev/shm segments it left, and only those.

Real processes: small Python scripts that create or attach POSIX shared memory (Python's
``SharedMemory``, the ``psm_*`` files vLLM's shm broadcast leaves) and sleep, some with a child
of their own (vLLM's engine core and workers)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from multiprocessing import shared_memory
from pathlib import Path
from typing import Any

import pytest

from app.harness.local_pd import LocalPD
from app.harness.proc_tree import kill_trees, process_tree, remove_orphans, shm_segments_of

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm")

# Creates ``create``, attaches ``attach`` (1 MiB each, one page touched), starts ``child`` (the
# same script) and waits for it, prints "ready", sleeps. No resource tracker: it would unlink
# the segments itself once its parent died, and this is about what nothing else cleans up.
HOLDER = """
import json, subprocess, sys, time
from multiprocessing import resource_tracker, shared_memory
resource_tracker.register = lambda *a, **k: None
spec = json.loads(sys.argv[1])
held = [shared_memory.SharedMemory(n, create=True, size=1 << 20) for n in spec["create"]]
held += [shared_memory.SharedMemory(n) for n in spec.get("attach", [])]
for s in held:
    s.buf[0] = 1
if spec.get("child"):
    kid = subprocess.Popen(
        [sys.executable, sys.argv[0], json.dumps(spec["child"])], stdout=subprocess.PIPE, text=True
    )
    assert kid.stdout is not None and kid.stdout.readline() == "ready\\n"
print("ready", flush=True)
time.sleep(600)
"""


def _running(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in "ZX"


class Holders:
    """The test's processes and segment names, all removed at the end."""

    def __init__(self, tmp_path: Path) -> None:
        self.script = tmp_path / "holder.py"
        self.script.write_text(HOLDER)
        self.procs: list[subprocess.Popen[bytes]] = []
        self.names: list[str] = []
        self.pids: list[int] = []

    def name(self) -> str:
        n = f"psm_test_{uuid.uuid4().hex[:12]}"
        self.names.append(n)
        return n

    def start(self, spec: dict[str, Any]) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(
            [sys.executable, str(self.script), json.dumps(spec)], stdout=subprocess.PIPE
        )
        self.procs.append(proc)
        assert proc.stdout is not None and proc.stdout.readline() == b"ready\n", "holder failed"
        self.pids += process_tree(proc.pid)
        return proc

    def close(self) -> None:
        for pid in self.pids:
            if _running(pid):
                os.kill(pid, signal.SIGKILL)
        for proc in self.procs:
            proc.wait(30)
            assert proc.stdout is not None
            proc.stdout.close()
        for n in self.names:
            Path(f"/dev/shm/{n}").unlink(missing_ok=True)


@pytest.fixture
def holders(tmp_path: Path) -> Iterator[Holders]:
    h = Holders(tmp_path)
    try:
        yield h
    finally:
        h.close()


def shm(name: str) -> bool:
    return Path(f"/dev/shm/{name}").exists()


def test_kill_removes_what_the_killed_tree_left(tmp_path: Path, holders: Holders) -> None:
    """SIGKILL through ``LocalPD.kill`` (the chaos tests' kills): the segments of the process
    and of its child go; a live process's own, and one it shares with the killed, stay."""
    own, kids, other, shared = (holders.name() for _ in range(4))
    live = holders.start({"create": [other, shared]})
    doomed = holders.start({"create": [own], "attach": [shared], "child": {"create": [kids]}})
    tree = process_tree(doomed.pid)
    assert len(tree) == 2, tree
    assert all(map(shm, (own, kids, other, shared)))

    pd = LocalPD(tmp_path / "model", tmp_path / "work")
    pd.procs["vllm-doomed"] = doomed
    pd.kill("vllm-doomed")

    assert doomed.returncode == -signal.SIGKILL
    assert not any(map(_running, tree)), "the killed process's child still runs"
    assert not shm(own), "the killed process's segment is left"
    assert not shm(kids), "the killed process's child's segment is left"
    assert shm(other) and shm(shared), "a live process's segment was removed"
    assert live.poll() is None


def test_stop_with_sigterm_kills_what_is_left_and_cleans_up(holders: Holders) -> None:
    """Another signal goes to the root; its child, still running after the timeout, is killed;
    what both left is removed (and returned)."""
    own, kids = holders.name(), holders.name()
    proc = holders.start({"create": [own], "child": {"create": [kids]}})
    tree = process_tree(proc.pid)

    removed = kill_trees([proc.pid], signal.SIGTERM, timeout_s=1.0)

    assert proc.wait(5) == -signal.SIGTERM
    assert not any(map(_running, tree))
    assert {Path(s.path).name for s in removed} == {own, kids}
    assert not shm(own) and not shm(kids)


def test_close_removes_the_segments_of_every_process(tmp_path: Path, holders: Holders) -> None:
    a, b = holders.name(), holders.name()
    pd = LocalPD(tmp_path / "model", tmp_path / "work")
    pd.procs = {
        "sidecar-x": holders.start({"create": [a]}),
        "vllm-x": holders.start({"create": [b]}),
    }
    pd.close()
    assert [p.returncode for p in pd.procs.values()] == [-signal.SIGTERM] * 2
    assert not shm(a) and not shm(b)


def test_a_name_made_again_after_the_record_is_kept(holders: Holders) -> None:
    """A segment whose name now holds another file (a restarted engine's) is not removed."""
    again, gone = holders.name(), holders.name()
    proc = holders.start({"create": [again, gone]})
    recorded = shm_segments_of(process_tree(proc.pid))
    assert {Path(s.path).name for s in recorded} >= {again, gone}
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(30)

    Path(f"/dev/shm/{again}").unlink()
    fresh = shared_memory.SharedMemory(again, create=True, size=4096)
    fresh.close()  # no process maps it: only the changed inode keeps it
    try:
        removed = remove_orphans(recorded)
        assert [Path(s.path).name for s in removed] == [gone]
        assert shm(again) and not shm(gone)
    finally:
        fresh.unlink()
