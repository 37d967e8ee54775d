"""The connector's pool thread tells vLLM a load or save ended only once nothing in the store
can still touch its blocks: a pending reply or a link that gave up keeps the request out of
``get_finished`` until a poll finds it settled. A fake link: this is the thread's logic."""

from __future__ import annotations

import dataclasses
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from app.connectors.vllm.metadata import PoolJob
from app.connectors.vllm.pool import PoolJobs
from app.errors import DeadlineExceeded
from app.transfer.wire.protocol import PoolLoaded


class FakeLink:
    def __init__(self) -> None:
        self.running_loads: set[str] = set()
        self.running_saves: set[str] = set()
        self.polls = 0

    def pool_load(self, req_id: str, *args: Any, **kwargs: Any) -> PoolLoaded:
        if req_id == "slow-link":
            raise DeadlineExceeded("no reply from the sidecar to PoolLoad within 30s")
        return PoolLoaded(loaded=0, bytes=0, failed_blocks=[[1]], pending=req_id == "late")

    def pool_save(self, req_id: str, *args: Any, **kwargs: Any) -> dict[str, int]:
        return {"stored": 0, "pending": int(req_id == "late-save")}

    def pool_poll(self, loads: list[str], saves: list[str]) -> tuple[set[str], set[str]]:
        self.polls += 1
        return self.running_loads & set(loads), self.running_saves & set(saves)

    def close(self, unlink: bool = False) -> None:
        pass


def _jobs() -> tuple[PoolJobs, FakeLink]:
    # The real constructor opens an engine link: set its fields by hand instead.
    jobs = PoolJobs.__new__(PoolJobs)
    link = FakeLink()
    jobs.link = link  # type: ignore[assignment]
    jobs._thread = ThreadPoolExecutor(max_workers=1)
    jobs._lock = threading.Lock()
    jobs._loaded, jobs._saved, jobs._failed = set(), set(), set()
    jobs._late_loads, jobs._late_saves = set(), set()
    jobs._running, jobs._running_done = set(), set()
    jobs._floors = {}
    jobs._polling, jobs._polled_at = False, 0.0
    return jobs, link


def _job(req: str) -> PoolJob:
    return PoolJob(req, [1, 2, 3], [[1]], 2)


def _drain_until(jobs: PoolJobs, want: str, timeout_s: float = 2.0) -> tuple[set[str], ...]:
    seen: tuple[set[str], ...] = (set(), set(), set())
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        out = jobs.drain()
        seen = tuple(a | b for a, b in zip(seen, out, strict=True))
        if any(want in s for s in seen):
            return seen
        time.sleep(0.02)
    return seen


def test_a_pending_load_is_reported_only_once_settled_and_then_recomputed() -> None:
    jobs, link = _jobs()
    link.running_loads = {"late", "slow-link"}
    for req in ("late", "slow-link", "fast"):
        jobs.load(_job(req))
    loaded, _, failed = _drain_until(jobs, "fast")
    time.sleep(0.3)  # polls come and go: both still run
    more = jobs.drain()
    assert "late" not in loaded | more[0] and "slow-link" not in loaded | more[0]
    assert jobs.late[0] == {"late", "slow-link"} and link.polls >= 1
    link.running_loads = set()
    loaded, _, failed = _drain_until(jobs, "late")
    loaded2, _, failed2 = _drain_until(jobs, "slow-link")
    assert {"late", "slow-link"} <= (loaded | loaded2) and {"late", "slow-link"} <= (
        failed | failed2
    )
    assert jobs.late == (set(), set())


def test_a_pending_save_keeps_its_blocks_until_settled() -> None:
    jobs, link = _jobs()
    link.running_saves = {"late-save"}
    jobs.save(_job("late-save"))
    jobs.save(_job("quick"))
    _, saved, _ = _drain_until(jobs, "quick")
    time.sleep(0.3)
    assert "late-save" not in saved | jobs.drain()[1]
    link.running_saves = set()
    _, saved, _ = _drain_until(jobs, "late-save")
    assert "late-save" in saved


def test_a_running_requests_late_store_ends_through_take_running() -> None:
    """A store while its request runs never reaches ``finished_sending`` (vLLM would free the
    running request's blocks): it ends, once settled, through ``take_running``."""
    jobs, link = _jobs()
    link.running_saves = {"late-save"}
    jobs.save(dataclasses.replace(_job("late-save"), running=True))
    time.sleep(0.3)
    assert jobs.take_running() == set()
    link.running_saves = set()
    done: set[str] = set()
    deadline = time.monotonic() + 5
    while "late-save" not in done and time.monotonic() < deadline:
        assert "late-save" not in jobs.drain()[1]
        done |= jobs.take_running()
        time.sleep(0.06)
    assert done == {"late-save"}
