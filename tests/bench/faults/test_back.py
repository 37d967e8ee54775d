"""``bench faults``: when goodput is back after a kill (``faults.plan.goodput_back``)."""

from __future__ import annotations

from app.bench.faults.plan import Point, back_target, goodput_back

KILL = 100.0


def _points(goods: str, start: float = KILL, gap: float = 1.0) -> list[Point]:
    """One request a ``gap`` apart per character: ``g`` good, ``x`` not, ``.`` still running."""
    return [
        Point(start + i * gap, None if c == "." else start + i * gap + 0.5, c == "g")
        for i, c in enumerate(goods)
    ]


def test_back_at_the_first_request_of_a_held_run_of_good_windows() -> None:
    # 5 bad, then good from the 6th request (sent 5 s after the kill) on.
    pts = _points("xxxxx" + "g" * 30)
    assert goodput_back(pts, KILL, window=5, target=0.9, hold_s=10) == 5.0


def test_requests_sent_before_the_kill_do_not_count() -> None:
    pts = _points("g" * 20, start=KILL - 20) + _points("xxx" + "g" * 30)
    assert goodput_back(pts, KILL, window=5, target=0.9, hold_s=10) == 3.0
    pts = _points("x" * 20, start=KILL - 20) + _points("g" * 30)
    assert goodput_back(pts, KILL, window=5, target=0.9, hold_s=10) == 0.0


def test_a_window_may_miss_by_the_target_share() -> None:
    # Windows of 10 at 0.9 allow one miss each: the lone miss does not hold the return back.
    pts = _points("xx" + "ggggxggggg" * 4)
    assert goodput_back(pts, KILL, window=10, target=0.9, hold_s=10) == 2.0


def test_the_return_is_never_dated_at_a_request_that_missed() -> None:
    # The window starting at the lone miss meets 0.9 (9 of 10), but the return is the next one.
    pts = _points("x" + "g" * 40)
    assert goodput_back(pts, KILL, window=10, target=0.9, hold_s=10) == 1.0


def test_a_relapse_within_the_hold_moves_the_return_later() -> None:
    # Good for 6 requests, then down again for 6, then good for good.
    pts = _points("xxx" + "g" * 6 + "x" * 6 + "g" * 40)
    back = goodput_back(pts, KILL, window=5, target=0.9, hold_s=8)
    assert back == 15.0


def test_undecided_while_a_window_is_still_running_or_too_short() -> None:
    assert goodput_back(_points("xx" + "g" * 5 + "." + "g" * 20), KILL, 5, 0.9, 10) is None
    assert goodput_back(_points("xx" + "g" * 8), KILL, 5, 0.9, 10) is None  # load over early


def test_never_back_when_no_window_meets_it() -> None:
    assert goodput_back(_points("gx" * 30), KILL, 10, 0.9, 5) is None


def test_the_target_is_a_share_of_the_control_phase() -> None:
    assert back_target(None) == 0.9
    assert back_target(0.8) == 0.9 * 0.8
