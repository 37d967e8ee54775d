"""``bench pd``'s compute regimes: which core runs what, and the CPU time of the transfer paths.

Three regimes, the same for both systems:

- ``shared``: every engine's OpenMP threads on all cores; nothing else pinned (the OS shares
  the cores between the forward passes, the sidecars, proxies, taps and Mooncake's threads).
- ``dedicated``: what an accelerator host has, compute on the device and the transfer on the
  host. Every engine's OpenMP runs one thread on the compute core (core 0); everything else
  runs on the transfer core (core 1): the sidecars, proxies, taps, the bench's client, the
  engines' API servers and engine cores, and every thread of the engines' workers but the
  forward's own. Mooncake's threads inside vLLM's ``MooncakeConnector`` are born there:
  ``mooncake_peer`` builds the connector from a thread pinned to ``KVS_BENCH_TRANSFER_CPUS``
  (``run_on_transfer_thread``), so every thread its transfer engine starts inherits it.
- ``split`` (``bench load`` only): prefill and decode compute in parallel, as on two devices.
  Prefill's forward runs one OpenMP thread on core 0, decode's on core 1 (each engine gets its
  own ``VLLM_CPU_OMP_THREADS_BIND``: ``role_env``); everything else floats over all cores, as in
  ``shared``. Pinning the forward leaves its worker's other threads (and Mooncake's, the
  connector's) on its core: ``place_threads`` moves them back to all cores.

vLLM's CPU worker binds its OpenMP threads through libgomp (``OMP_PLACES``, set from
``VLLM_CPU_OMP_THREADS_BIND``), which binds the initial thread when torch loads it, and drops
places outside the process's own affinity. So engines cannot be started inside ``taskset -c 1``
(libgomp then finds no usable place and binds nothing); they start on all cores and
``place_threads`` moves every other thread to the transfer core once they serve (and again
after each warm-up, for threads started since). ``VLLM_CPU_NUM_OF_RESERVED_CPU`` only matters
to vLLM's automatic binding, which an explicit ``VLLM_CPU_OMP_THREADS_BIND`` replaces.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar

from app.errors import ConfigError

REGIMES = ("shared", "dedicated")
LOAD_REGIMES = (*REGIMES, "split")  # split: one engine a core, only where load is measured
TRANSFER_CPUS_ENV = "KVS_BENCH_TRANSFER_CPUS"  # read by mooncake_peer inside the engines
MOONCAKE_THREAD = "kvs-mooncake"  # the OS name of every thread MooncakeConnector starts
_PR_SET_NAME = 15
T = TypeVar("T")


@dataclass(frozen=True)
class Binding:
    """One regime on this machine's cores."""

    regime: str
    compute: tuple[int, ...]  # the engines' OpenMP threads
    transfer: tuple[int, ...] | None  # everything else; None: not pinned (shared)
    # split: the core of each role's forward ((role, core), ...); empty: every engine's the same
    roles: tuple[tuple[str, int], ...] = ()

    def env(self) -> dict[str, str]:
        """What every process of both systems gets (engines read the first two)."""
        out = {"OMP_NUM_THREADS": "1" if self.roles else str(len(self.compute))}
        if not self.roles:
            out["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(str(c) for c in self.compute)
        if self.transfer is not None:
            out[TRANSFER_CPUS_ENV] = ",".join(str(c) for c in self.transfer)
        return out

    def role_env(self) -> dict[str, dict[str, str]]:
        """What each role's engine gets on top of ``env`` (split: its own forward core)."""
        return {role: {"VLLM_CPU_OMP_THREADS_BIND": str(core)} for role, core in self.roles}

    def describe(self) -> str:
        if self.roles:
            cores = ", ".join(f"{role}'s on core {core}" for role, core in self.roles)
            return (
                f"cores (split): each engine's OpenMP: 1 thread, {cores} (same for both "
                "systems); sidecars, proxies, taps, the client, every other engine thread and "
                "Mooncake's on all cores"
            )
        omp = ",".join(str(c) for c in self.compute)
        head = (
            f"cores ({self.regime}): every engine's OpenMP: {len(self.compute)} thread(s) on "
            f"{omp} (VLLM_CPU_OMP_THREADS_BIND={omp}, same for both systems)"
        )
        if self.transfer is None:
            return head + "; sidecars, proxies, taps and Mooncake's threads unpinned"
        core = ",".join(str(c) for c in self.transfer)
        return (
            f"{head}; on core {core}: sidecars, proxies, taps, the client, the engines' API "
            "servers, engine cores and every worker thread but the forward's, Mooncake's "
            f"transfer threads (born there: {TRANSFER_CPUS_ENV}={core})"
        )

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {"env": self.env(), "text": self.describe()}


def binding(regime: str, cores: Iterable[int]) -> Binding:
    """``regime`` on ``cores`` (the process's affinity): shared = today's binding, OpenMP on
    all of them; dedicated = OpenMP on the first, the transfer path on the second."""
    cs = tuple(sorted(cores))
    if regime == "shared":
        return Binding(regime, cs, None)
    if regime == "dedicated":
        if len(cs) < 2:
            raise ConfigError(f"--regime dedicated needs two cores; this process has {list(cs)}")
        return Binding(regime, cs[:1], cs[1:2])
    if regime == "split":
        if len(cs) < 2:
            raise ConfigError(f"--regime split needs two cores; this process has {list(cs)}")
        return Binding(regime, cs[:2], cs, (("prefill", cs[0]), ("decode", cs[1])))
    raise ConfigError(f"--regime {regime!r}: expected one of {', '.join(LOAD_REGIMES)}")


# ---- the transfer thread (used inside the engines by mooncake_peer) --------------------------


def cpus_from_env(value: str | None) -> set[int] | None:
    """``"1"`` or ``"1,3"`` -> {1} / {1, 3}; unset or empty -> None (do not pin)."""
    if not value or not value.strip():
        return None
    return {int(c) for c in value.split(",") if c.strip()}


def run_on_transfer_thread(fn: Callable[[], T], name: str = MOONCAKE_THREAD) -> T:
    """``fn()`` on a new thread named ``name`` (its OS name, inherited by every thread it
    starts, so the transfer path's CPU time can be read per thread), pinned to the CPUs in
    ``KVS_BENCH_TRANSFER_CPUS`` when set (inherited the same way). Returns or raises what
    ``fn`` did."""
    cpus = cpus_from_env(os.environ.get(TRANSFER_CPUS_ENV))
    out: dict[str, Any] = {}

    def body() -> None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)
            if cpus is not None:
                os.sched_setaffinity(0, cpus)  # 0: this thread (Linux affinity is per thread)
            out["value"] = fn()
        except BaseException as e:  # handed to the caller's thread
            out["error"] = e

    t = threading.Thread(target=body, name=name)
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]
    value: T = out["value"]
    return value


# ---- /proc: processes, threads, CPU time -----------------------------------------------------


def stat_cpu_ticks(line: str) -> int:
    """utime + stime (clock ticks) from a ``/proc/<pid>[/task/<tid>]/stat`` line. The command
    name (field 2) may hold spaces and parentheses: fields are counted after its last ')'."""
    rest = line[line.rindex(")") + 2 :].split()
    return int(rest[11]) + int(rest[12])  # fields 14 and 15; rest[0] is field 3


def stat_ppid(line: str) -> int:
    return int(line[line.rindex(")") + 2 :].split()[1])  # field 4


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None  # gone since it was listed


def descendants(
    roots: Iterable[int], proc: Path = Path("/proc"), stop: Iterable[int] = ()
) -> list[int]:
    """``roots`` and every process below them (vLLM's engine core and workers, a sidecar's
    children), from each process's parent in ``/proc/*/stat``; not below ``stop`` (the roots
    of other groups: the bench's own children are the systems' processes)."""
    stopped = set(stop)
    children: dict[int, list[int]] = {}
    for d in proc.iterdir():
        if d.name.isdigit() and (text := _read(d / "stat")) is not None:
            children.setdefault(stat_ppid(text), []).append(int(d.name))
    out: list[int] = []
    todo = [r for r in roots if (proc / str(r)).exists()]
    while todo:
        pid = todo.pop()
        if pid not in out:
            out.append(pid)
            todo.extend(c for c in children.get(pid, ()) if c not in stopped)
    return out


@dataclass(frozen=True)
class ThreadInfo:
    pid: int
    tid: int
    name: str  # /proc/<pid>/task/<tid>/comm
    cpus: frozenset[int]
    ticks: int  # utime + stime
    ppid: int = 0  # the process's parent


def proc_usage(pids: Iterable[int], proc: Path = Path("/proc")) -> dict[str, float]:
    """Resident memory (MiB), threads and open descriptors of ``pids`` together (a process
    gone since it was listed counts nothing)."""
    rss_kib = n_threads = fds = 0
    for pid in pids:
        try:
            for line in (proc / str(pid) / "status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    rss_kib += int(line.split()[1])
                elif line.startswith("Threads:"):
                    n_threads += int(line.split()[1])
            fds += len(os.listdir(proc / str(pid) / "fd"))
        except OSError:
            continue
    return {"rss_mib": rss_kib / 1024, "fds": fds, "threads": n_threads}


def threads(pid: int, proc: Path = Path("/proc")) -> list[ThreadInfo]:
    out = []
    task = proc / str(pid) / "task"
    try:
        tids = [int(t.name) for t in task.iterdir()]
    except (FileNotFoundError, ProcessLookupError):
        return []
    if (own := _read(proc / str(pid) / "stat")) is None:
        return []
    ppid = stat_ppid(own)
    for tid in tids:
        name, stat = _read(task / str(tid) / "comm"), _read(task / str(tid) / "stat")
        if name is None or stat is None:
            continue
        try:
            cpus = frozenset(os.sched_getaffinity(tid))
        except ProcessLookupError:
            continue
        out.append(ThreadInfo(pid, tid, name.strip(), cpus, stat_cpu_ticks(stat), ppid))
    return out


def process_cpu_s(pids: Iterable[int], proc: Path = Path("/proc")) -> float:
    """CPU seconds (user + system) the processes have used, all their threads, ended ones too.
    On the real ``/proc`` each process's CPU clock is read in nanoseconds: ``stat`` counts
    10 ms ticks, and a short transfer's sidecars can use less than one."""
    total = 0.0
    for pid in pids:
        if proc == Path("/proc"):
            try:
                total += time.clock_gettime(_process_cpu_clock(pid))
                continue
            except OSError:
                pass  # gone, or its clock not readable here: its ticks, if any
        if (text := _read(proc / str(pid) / "stat")) is not None:
            total += stat_cpu_ticks(text) / os.sysconf("SC_CLK_TCK")
    return total


def _process_cpu_clock(pid: int) -> int:
    # What glibc's clock_getcpuclockid(pid) returns (Linux's CPUCLOCK_SCHED of the whole
    # process); Python does not wrap it.
    return ((~pid) << 3) | 2


def named_threads_cpu_s(pids: Iterable[int], name: str) -> tuple[float, int]:
    """CPU seconds of the threads called ``name`` in these processes, and how many there are
    (a thread that ended took its time with it)."""
    found = [t for pid in pids for t in threads(pid) if t.name == name]
    return sum(t.ticks for t in found) / os.sysconf("SC_CLK_TCK"), len(found)


# ---- placing threads (dedicated regime) ------------------------------------------------------


def forward_threads(ts: Sequence[ThreadInfo], compute: Iterable[int]) -> set[int]:
    """The forward passes' threads: each main thread bound to one compute core whose process's
    parent is not (a vLLM CPU worker: libgomp bound it when torch loaded; every regime that
    pins runs one OpenMP thread an engine). A process such a thread started (Python's resource
    tracker, for one) inherited the binding: not a forward."""
    comp = frozenset(compute)

    def bound(cpus: frozenset[int]) -> bool:
        return len(cpus) == 1 and cpus <= comp

    main = {t.pid: t.cpus for t in ts if t.tid == t.pid}
    return {
        t.tid
        for t in ts
        if t.tid == t.pid and bound(t.cpus) and not (t.ppid in main and bound(main[t.ppid]))
    }


def to_move(ts: Sequence[ThreadInfo], compute: Iterable[int], transfer: Iterable[int]) -> list[int]:
    """The threads to pin to ``transfer``: all but the forwards' (``forward_threads``) and those
    already there. A thread a worker's main thread started later inherited the compute core,
    is not a forward, and moves."""
    keep, tran = forward_threads(ts, compute), frozenset(transfer)
    return [t.tid for t in ts if t.cpus != tran and t.tid not in keep]


def place_threads(groups: Mapping[str, Sequence[int]], b: Binding) -> list[dict[str, Any]]:
    """Where the regime pins (dedicated, split), pin every thread of these process trees to the
    transfer cores but the forwards' (see ``to_move``); in all, a snapshot of where each
    group's threads are:
    ``{"group", "pids", "threads": {"0": n, "0,1": n, ...}, "mooncake_threads": n}``."""
    out = []
    every_root = {r for roots in groups.values() for r in roots}
    for group, roots in groups.items():
        pids = descendants(roots, stop=every_root - set(roots))
        ts = [t for pid in pids for t in threads(pid)]
        if b.transfer is not None:
            for tid in to_move(ts, b.compute, b.transfer):
                with contextlib.suppress(ProcessLookupError):  # ended since it was listed
                    os.sched_setaffinity(tid, set(b.transfer))
            ts = [t for pid in pids for t in threads(pid)]
        where: dict[str, int] = {}
        for t in ts:
            key = ",".join(str(c) for c in sorted(t.cpus))
            where[key] = where.get(key, 0) + 1
        out.append(
            {
                "group": group,
                "pids": pids,
                "threads": dict(sorted(where.items())),
                "mooncake_threads": sum(1 for t in ts if t.name == MOONCAKE_THREAD),
                "forward_threads": len(forward_threads(ts, b.compute))
                if b.transfer is not None
                else None,
            }
        )
    return out


def placement_text(snapshot: Sequence[Mapping[str, Any]]) -> str:
    lines = ["threads by core (group: cores -> threads):"]
    for g in snapshot:
        where = ", ".join(f"{{{k}}}: {n}" for k, n in g["threads"].items())
        extra = f"; Mooncake's: {g['mooncake_threads']}" if g["mooncake_threads"] else ""
        lines.append(f"  {g['group']}: {where}{extra}")
    return "\n".join(lines)
