"""``bench load``'s breakdown of decode's time to target from the proxy's and sidecars' records."""

from __future__ import annotations

import pytest

from app.bench.core.target_path import summarize, target_times

COLS = ["step", "layer", "group", "signalled_at", "at_step_end", "submitted_at", "landed_at"]


def _send(tid: str, submitted: list[float | None]) -> dict:
    rows = [[0, i, 0, 1.0, False, t, None] for i, t in enumerate(submitted)]
    return {"id": tid, "side": "send", "layer_columns": COLS, "layers": rows}


PROXY = [
    {"transfer_id": "a", "started_at": 100.0, "target_ms": 30.0, "disaggregated": True},
    {"transfer_id": "b", "started_at": 200.0, "target_ms": None, "disaggregated": False},
    {"transfer_id": "old", "started_at": 50.0, "target_ms": 10.0, "disaggregated": True},
]
RECORDS = [
    {"id": "a", "side": "recv", "created_at": 100.012},
    {"id": "a", "side": "recv", "created_at": 100.010},  # a second decode rank: the first counts
    _send("a", [None, 100.051, 100.045]),  # the earliest layer submitted, not the first listed
    _send("a", [100.060]),  # prefill's other rank
]


def test_each_stage_is_measured_from_the_proxys_start() -> None:
    (row,) = target_times(PROXY, RECORDS, ["a", "b"])
    assert row["transfer_id"] == "a"
    assert row["announced_ms"] == pytest.approx(10.0)
    assert row["target_ms"] == 30.0
    assert row["first_write_ms"] == pytest.approx(45.0)


def test_local_requests_and_other_steps_transfers_are_left_out() -> None:
    assert target_times(PROXY, RECORDS, ["b", "c"]) == []


def test_a_missing_record_leaves_its_stage_empty_and_the_summary_counts_it() -> None:
    rows = target_times(PROXY, [], ["a", "old"])
    assert [r["announced_ms"] for r in rows] == [None, None]
    s = summarize(rows)
    assert s["n"] == 2
    assert s["announced_ms"] == {"n": 0, "p50": None, "p90": None}
    assert s["target_ms"]["n"] == 2 and s["target_ms"]["p50"] == pytest.approx(20.0)
