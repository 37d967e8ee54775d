"""Stopping local process trees, and removing the /dev/shm segments they leave behind."""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import NamedTuple

log = logging.getLogger(__name__)


# ---- stopping process trees, and the /dev/shm segments they leave ------------------------------
# A killed process leaves its POSIX shared memory behind: vLLM's shm broadcast queues (psm_*,
# Python's SharedMemory) and its CPU communicator's (vllm_*) stayed in /dev/shm, hundreds of MiB,
# after the chaos tests killed engines.

SHM_DIR = "/dev/shm/"
_DELETED = " (deleted)"  # how /proc shows an unlinked file


class ShmSegment(NamedTuple):
    """A file in /dev/shm as a process held it: its path, and its device and inode then."""

    path: str
    dev: int
    ino: int


def proc_stat(pid: int) -> tuple[int, str, int] | None:
    """``(ppid, state, start time)`` of a process, from ``/proc/<pid>/stat``; None if gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    fields = raw[raw.rindex(b")") + 2 :].split()  # after "pid (comm) "
    return int(fields[1]), fields[0].decode(), int(fields[19])


def _pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants (by /proc's parent links), parents first."""
    children: dict[int, list[int]] = {}
    for p in _pids():
        st = proc_stat(p)
        if st is not None:
            children.setdefault(st[0], []).append(p)
    out, i = [pid], 0
    while i < len(out):
        out.extend(children.get(out[i], []))
        i += 1
    return out


def _held(pid: int) -> set[ShmSegment]:
    """The /dev/shm files ``pid`` maps or has open (unlinked ones end in " (deleted)").

    Raises OSError where its /proc cannot be read (PermissionError) or it is gone."""
    held: set[ShmSegment] = set()
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            # address perms offset major:minor inode path
            parts = line.rstrip("\n").split(maxsplit=5)
            if len(parts) == 6 and parts[5].startswith(SHM_DIR):
                major, minor = (int(x, 16) for x in parts[3].split(":"))
                held.add(ShmSegment(parts[5], os.makedev(major, minor), int(parts[4])))
    fds = f"/proc/{pid}/fd"
    for fd in os.listdir(fds):
        try:
            target = os.readlink(f"{fds}/{fd}")
            if target.startswith(SHM_DIR):
                st = os.stat(f"{fds}/{fd}")
                held.add(ShmSegment(target, st.st_dev, st.st_ino))
        except OSError:  # closed meanwhile
            continue
    return held


def shm_segments_of(pids: Iterable[int]) -> set[ShmSegment]:
    """The /dev/shm files (still linked) that the processes ``pids`` map or have open; those
    whose /proc cannot be read are skipped."""
    out: set[ShmSegment] = set()
    for pid in pids:
        try:
            out |= {s for s in _held(pid) if not s.path.endswith(_DELETED)}
        except OSError:
            continue
    return out


def _live_holders() -> tuple[set[tuple[int, int]], list[int]]:
    """``(dev, inode)`` of every /dev/shm file a live process maps or has open, and the live
    processes whose /proc could not be read."""
    held: set[tuple[int, int]] = set()
    unread = []
    for pid in _pids():
        try:
            held |= {(s.dev, s.ino) for s in _held(pid)}
        except PermissionError:
            unread.append(pid)
        except OSError:  # gone
            continue
    return held, unread


def remove_orphans(segments: Iterable[ShmSegment]) -> list[ShmSegment]:
    """Unlink those of ``segments`` that no live process maps or has open; returns them.

    A segment is kept if its path now names another file (its inode changed: created after
    ``segments`` were recorded, e.g. by a restarted engine). Processes whose /proc cannot be
    read (another user's; here the sandbox's PID 1) are taken to hold none of them, unless one
    descends from this process (started by the harness, it might): then nothing is removed."""
    held, unread = _live_holders()
    blind = set(unread) & set(process_tree(os.getpid()))
    if blind:
        log.warning("not removing /dev/shm segments: cannot read /proc of %s", sorted(blind))
        return []
    removed = []
    for seg in sorted(set(segments)):
        try:
            st = os.stat(seg.path)
        except FileNotFoundError:
            continue
        if (st.st_dev, st.st_ino) != (seg.dev, seg.ino) or (seg.dev, seg.ino) in held:
            continue
        try:
            os.unlink(seg.path)
        except OSError as e:
            if not isinstance(e, FileNotFoundError):
                log.warning("could not remove %s: %s", seg.path, e)
            continue
        log.info(
            "removed %s left by killed processes: %d bytes (%d allocated)",
            seg.path,
            st.st_size,
            st.st_blocks * 512,
        )
        removed.append(seg)
    return removed


def _alive(pid: int, start: int) -> bool:
    """Whether the process ``pid`` that started at ``start`` still runs (not a zombie)."""
    st = proc_stat(pid)
    return st is not None and st[2] == start and st[1] not in "ZX"


def signal_all(pids: Iterable[int], sig: int) -> None:
    """Send ``sig`` to each of ``pids``; those already gone are skipped."""
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            continue


def _wait_gone(members: dict[int, int], timeout_s: float) -> list[int]:
    """Until none of ``members`` (pid: start time) runs, or ``timeout_s``; those still alive."""
    deadline = time.monotonic() + timeout_s
    while True:
        alive = [p for p, start in members.items() if _alive(p, start)]
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(0.02)


def _wait_stopped(members: dict[int, int], timeout_s: float = 2.0) -> None:
    """Until each of ``members`` is stopped (or gone), for at most ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        states = [proc_stat(p) for p in members]
        if all(st is None or st[1] in "TtZX" for st in states):
            return
        time.sleep(0.005)


def kill_trees(
    roots: Sequence[int], sig: int = signal.SIGKILL, timeout_s: float = 30.0
) -> list[ShmSegment]:
    """Stop the processes ``roots`` and all their descendants, then remove the /dev/shm
    segments those processes mapped or had open that no live process holds any more.

    SIGKILL: the trees are first frozen (SIGSTOP), so that none forks or maps more between the
    record of their segments and the kill. Another signal goes to the roots only (their own
    shutdown stops their children); what of the trees still runs after ``timeout_s`` is
    killed. The roots are left to their parent to reap. Returns the segments removed."""
    members: dict[int, int] = {}  # pid: start time
    while True:  # until a walk finds no new process (frozen ones fork no more)
        new = {}
        for root in roots:
            for pid in process_tree(root):
                st = proc_stat(pid)
                if pid not in members and st is not None:
                    new[pid] = st[2]
        if not new:
            break
        members |= new
        if sig == signal.SIGKILL:
            signal_all(new, signal.SIGSTOP)
            _wait_stopped(new)
    segments = shm_segments_of(members)
    signal_all(members if sig == signal.SIGKILL else roots, sig)
    left = _wait_gone(members, timeout_s)
    if left:
        log.warning("%s still running %.0f s after signal %d: killed", left, timeout_s, sig)
        signal_all(left, signal.SIGKILL)
        left = _wait_gone(members, timeout_s)
    if left:
        log.warning("%s survived SIGKILL for %.0f s", left, timeout_s)
    return remove_orphans(segments)
