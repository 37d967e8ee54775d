"""A running request's store that failed on a rank leaves no hole its later stores skip
(issue 54): the rank's next store of the request starts from the failed one's floor, until one
succeeded. A fake link records what each save asked for: this is the pool thread's logic (the
sidecar's side of ``stored_tokens`` is tested on the real store)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from app.connectors.vllm.metadata import PoolJob
from app.connectors.vllm.pool import PoolJobs, request_of, running_save_id
from app.errors import ProtocolError


class RecordingLink:
    """Answers each save with the outcome queued for it; records ``stored_tokens``."""

    def __init__(self, outcomes: list[dict[str, int] | Exception]) -> None:
        self.outcomes = outcomes
        self.asked: list[tuple[str, int]] = []

    def pool_save(self, req_id: str, *args: Any, stored_tokens: int = 0) -> dict[str, int]:
        self.asked.append((req_id, stored_tokens))
        out = self.outcomes.pop(0)
        if isinstance(out, Exception):
            raise out
        return out

    def close(self, unlink: bool = False) -> None:
        pass


def _jobs(link: RecordingLink) -> PoolJobs:
    # The real constructor opens an engine link: set its fields by hand instead.
    jobs = PoolJobs.__new__(PoolJobs)
    jobs.link = link  # type: ignore[assignment]
    jobs._thread = ThreadPoolExecutor(max_workers=1)
    jobs._lock = threading.Lock()
    jobs._loaded, jobs._saved, jobs._failed = set(), set(), set()
    jobs._late_loads, jobs._late_saves = set(), set()
    jobs._running, jobs._running_done = set(), set()
    jobs._floors = {}
    jobs._polling, jobs._polled_at = False, 0.0
    return jobs


def _store(upto: int, stored: int, running: bool = True) -> PoolJob:
    sid = running_save_id("r", upto) if running else "r"
    return PoolJob(sid, list(range(upto)), [[1]], upto, stored=stored, running=running)


OK = {"stored": 4, "failed": 0, "backpressure": 0}


def _run(outcomes: list[dict[str, int] | Exception], jobs_: list[PoolJob]) -> list[int]:
    link = RecordingLink(outcomes)
    jobs = _jobs(link)
    for job in jobs_:
        jobs.save(job)
    jobs._thread.shutdown(wait=True)
    return [stored for _, stored in link.asked]


def test_save_ids_name_their_request() -> None:
    assert request_of(running_save_id("cmpl-1@x", 512)) == "cmpl-1@x"
    assert request_of("cmpl-1") == "cmpl-1"


def test_after_a_store_that_failed_keys_the_next_starts_from_its_floor() -> None:
    failed = {"stored": 2, "failed": 1, "backpressure": 0}
    asked = _run(
        [OK, failed, OK, OK], [_store(128, 0), _store(256, 128), _store(384, 256), _store(512, 384)]
    )
    # 256's store failed: 384's stores from 128 again, and once it succeeded 512's from 384.
    assert asked == [0, 128, 128, 384]


def test_refused_keys_and_a_link_error_count_as_failed() -> None:
    full = {"stored": 0, "failed": 0, "backpressure": 3}
    asked = _run(
        [full, ProtocolError("refused"), OK], [_store(128, 0), _store(256, 128), _store(384, 256)]
    )
    assert asked == [0, 0, 0]


def test_the_store_at_the_end_starts_from_the_floor_and_clears_it() -> None:
    failed = {"stored": 0, "failed": 2, "backpressure": 0}
    link = RecordingLink([failed, OK, OK])
    jobs = _jobs(link)
    jobs.save(_store(256, 128))
    jobs.save(_store(300, 256, running=False))
    jobs._thread.shutdown(wait=True)
    assert [s for _, s in link.asked] == [128, 128]
    assert jobs._floors == {}
