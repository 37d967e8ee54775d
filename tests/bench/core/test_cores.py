"""``bench pd``'s regimes (which core runs what) and CPU time from ``/proc``: no engines."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from app.bench.core.cores import (
    MOONCAKE_THREAD,
    TRANSFER_CPUS_ENV,
    ThreadInfo,
    binding,
    cpus_from_env,
    descendants,
    forward_threads,
    named_threads_cpu_s,
    proc_usage,
    process_cpu_s,
    run_on_transfer_thread,
    stat_cpu_ticks,
    stat_ppid,
    threads,
    to_move,
)
from app.errors import ConfigError
from tests.conftest import wait_for


def test_shared_regime_is_todays_binding() -> None:
    b = binding("shared", {1, 0})
    assert b.compute == (0, 1) and b.transfer is None
    assert b.env() == {"VLLM_CPU_OMP_THREADS_BIND": "0,1", "OMP_NUM_THREADS": "2"}
    assert "unpinned" in b.describe()


def test_dedicated_regime_one_omp_thread_on_core_0_the_transfer_on_core_1() -> None:
    b = binding("dedicated", [0, 1])
    assert b.compute == (0,) and b.transfer == (1,)
    assert b.env() == {
        "VLLM_CPU_OMP_THREADS_BIND": "0",
        "OMP_NUM_THREADS": "1",
        TRANSFER_CPUS_ENV: "1",
    }
    text = b.describe()
    assert "1 thread(s) on 0" in text and "on core 1" in text and "Mooncake" in text
    assert b.as_dict()["regime"] == "dedicated"
    # A bigger machine: still one core each (the regime, not the machine, is measured).
    assert binding("dedicated", range(8)).transfer == (1,)
    with pytest.raises(ConfigError):
        binding("dedicated", [0])
    with pytest.raises(ConfigError):
        binding("gpu", [0, 1])


def test_split_regime_one_forward_a_core_the_rest_on_all() -> None:
    b = binding("split", [1, 0])
    assert b.env() == {"OMP_NUM_THREADS": "1", TRANSFER_CPUS_ENV: "0,1"}
    # Each engine binds its own forward; no shared VLLM_CPU_OMP_THREADS_BIND overrides it.
    assert b.role_env() == {
        "prefill": {"VLLM_CPU_OMP_THREADS_BIND": "0"},
        "decode": {"VLLM_CPU_OMP_THREADS_BIND": "1"},
    }
    text = b.describe()
    assert "prefill's on core 0" in text and "decode's on core 1" in text
    assert binding("dedicated", [0, 1]).role_env() == {}
    with pytest.raises(ConfigError, match="split needs two cores"):
        binding("split", [3])


def test_transfer_cpus_from_env() -> None:
    assert cpus_from_env(None) is None and cpus_from_env(" ") is None
    assert cpus_from_env("1") == {1}
    assert cpus_from_env("1,3") == {1, 3}


def test_cpu_ticks_from_a_stat_line_whatever_the_command_name() -> None:
    # Fields 14 and 15 (utime, stime); the name may hold spaces and parentheses.
    tail = "S 1 2 3 4 5 6 7 8 9 10 250 40 11 12 20 0 3 0 99"
    assert stat_cpu_ticks(f"1234 (python3) {tail}") == 290
    assert stat_cpu_ticks(f"1234 (a b) c)) {tail}") == 290
    assert stat_ppid(f"1234 (a b) c)) {tail}") == 1
    # And a real one: this process has used some CPU, its parent is its parent.
    line = Path("/proc/self/stat").read_text()
    assert stat_cpu_ticks(line) >= 0
    assert stat_ppid(line) == os.getppid()


def test_process_trees_from_parents_stopping_at_other_groups(tmp_path: Path) -> None:
    tail = "S {ppid} 0 0 0 0 0 0 0 0 0 5 5 0 0 20 0 1 0 9"
    for pid, ppid in ((1, 0), (2, 1), (3, 2), (4, 1), (5, 4)):
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "stat").write_text(f"{pid} (p {pid}) {tail.format(ppid=ppid)}")
    (tmp_path / "self").mkdir()  # not a process directory
    assert sorted(descendants([1], tmp_path)) == [1, 2, 3, 4, 5]
    # The bench's own group: itself, not the systems' process trees under it.
    assert sorted(descendants([1], tmp_path, stop=[2])) == [1, 4, 5]
    assert sorted(descendants([2, 4], tmp_path)) == [2, 3, 4, 5]
    assert process_cpu_s([2, 3], tmp_path) == 20 / os.sysconf("SC_CLK_TCK")


def test_own_process_tree_and_cpu_time() -> None:
    tree = descendants([os.getpid()])
    assert tree[0] == os.getpid()
    assert descendants([2**22 + 7]) == []  # no such process
    sum(i * i for i in range(200_000))  # burn a little
    assert process_cpu_s([os.getpid()]) > 0
    # To the microsecond, not in 10 ms ticks: a short transfer's sidecars use less than one.
    assert abs(process_cpu_s([os.getpid()]) - time.process_time()) < 2e-3
    mine = threads(os.getpid())
    assert any(t.tid == threading.get_native_id() for t in mine)


def test_transfer_thread_is_named_pinned_and_inherited() -> None:
    seen: dict[str, object] = {}
    stop = threading.Event()

    def build() -> int:
        seen["cpus"] = os.sched_getaffinity(0)
        child = threading.Thread(target=stop.wait)  # like Mooncake's own threads
        child.start()
        seen["child"] = child
        return 7

    mine = os.sched_getaffinity(0)
    core = max(mine)
    os.environ[TRANSFER_CPUS_ENV] = str(core)
    try:
        assert run_on_transfer_thread(build) == 7
        assert seen["cpus"] == {core}

        def only_the_child() -> list[ThreadInfo] | None:
            named = [t for t in threads(os.getpid()) if t.name == MOONCAKE_THREAD]
            return named if len(named) == 1 else None

        # The joined transfer thread can linger in /proc/<pid>/task for a moment after
        # join() returned (Python releases its join lock before the OS thread exits).
        named = wait_for("the finished transfer thread to leave /proc", only_the_child, 5.0)
        assert len(named) == 1 and named[0].cpus == {core}  # the child inherited both
        cpu_s, n = named_threads_cpu_s([os.getpid()], MOONCAKE_THREAD)
        assert n == 1 and cpu_s >= 0
    finally:
        stop.set()
        child = seen["child"]
        assert isinstance(child, threading.Thread)
        child.join()
        del os.environ[TRANSFER_CPUS_ENV]
    assert os.sched_getaffinity(0) == mine  # the caller's thread is left as it was

    def fail() -> None:
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        run_on_transfer_thread(fail)


def test_only_the_forward_stays_on_the_compute_core() -> None:
    def t(pid: int, tid: int, cpus: set[int], ppid: int = 1, name: str = "x") -> ThreadInfo:
        return ThreadInfo(pid, tid, name, frozenset(cpus), 0, ppid)

    ts = [
        t(20, 20, {0, 1}),  # an engine core (or API server, sidecar, proxy, tap): moves
        t(20, 21, {0, 1}),
        t(10, 10, {0}, ppid=20),  # its vLLM CPU worker's main thread: libgomp bound it
        t(10, 11, {0}, ppid=20),  # a thread the worker started since: inherited it, moves
        t(10, 12, {1}, ppid=20, name=MOONCAKE_THREAD),  # born on the transfer core: stays
        t(30, 30, {0}, ppid=10),  # a process the worker started (resource tracker): moves
    ]
    assert forward_threads(ts, [0]) == {10}
    assert to_move(ts, [0], [1]) == [20, 21, 11, 30]


def test_split_keeps_both_forwards_and_frees_what_they_started() -> None:
    def t(pid: int, tid: int, cpus: set[int], ppid: int = 1) -> ThreadInfo:
        return ThreadInfo(pid, tid, "x", frozenset(cpus), 0, ppid)

    ts = [
        t(20, 20, {0, 1}),  # prefill's engine core: already on all cores
        t(10, 10, {0}, ppid=20),  # prefill's worker's forward
        t(10, 11, {0}, ppid=20),  # a thread prefill's worker started: inherited core 0, freed
        t(40, 40, {0, 1}),  # decode's engine core
        t(50, 50, {1}, ppid=40),  # decode's worker's forward
        t(50, 51, {1}, ppid=40),  # e.g. the connector's thread: freed
        t(60, 60, {1}, ppid=50),  # a process decode's worker started: freed
    ]
    assert forward_threads(ts, [0, 1]) == {10, 50}
    assert to_move(ts, [0, 1], [0, 1]) == [11, 51, 60]


def test_proc_usage_sums_rss_threads_and_descriptors_and_skips_the_gone(tmp_path: Path) -> None:
    for pid, rss, n, fds in ((10, 2048, 3, 4), (11, 1024, 2, 1)):
        d = tmp_path / str(pid)
        (d / "fd").mkdir(parents=True)
        (d / "status").write_text(f"Name:\tx\nVmRSS:\t{rss} kB\nThreads:\t{n}\n")
        for k in range(fds):
            (d / "fd" / str(k)).touch()
    assert proc_usage([10, 11, 99], proc=tmp_path) == {"rss_mib": 3.0, "fds": 5, "threads": 5}
