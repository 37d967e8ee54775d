"""The retry budget: at most ``ratio`` retries per request of the last window, at least
``minimum``; spent, failures are answered as they came (no retry storm when all fail)."""

from __future__ import annotations

from collections.abc import Callable

from app.proxy.retries import BudgetSettings, RetryBudget
from tests.conftest import Clock
from tests.proxy.conftest import Cluster, sample


def test_the_budget_allows_its_minimum_then_its_ratio_over_the_window() -> None:
    clock = Clock(1000.0)
    b = RetryBudget(BudgetSettings(ratio=0.1, minimum=2, window_s=10.0), clock)
    for _ in range(5):
        b.request()
    assert [b.take() for _ in range(3)] == [True, True, False]  # the minimum: 5 x 0.1 < 2
    for _ in range(25):
        b.request()
    assert (b.allowed(), b.take(), b.take()) == (3, True, False)  # 30 requests: 3
    clock.now += 5.0
    assert not b.take()  # still within the window
    clock.now += 5.1  # the window moved past all of it
    assert (b.allowed(), b.used(), b.take()) == (2, 0, True)


def test_a_zero_budget_never_retries() -> None:
    b = RetryBudget(BudgetSettings(ratio=0.0, minimum=0))
    for _ in range(100):
        b.request()
    assert not b.take()


def test_a_spent_budget_answers_the_failure(make_cluster: Callable[..., Cluster]) -> None:
    c = make_cluster(n_prefill=1, n_decode=2).start_proxy(
        decode_policy="round_robin", retry_budget_ratio=0.0, retry_budget_min=1
    )
    d0, d1 = c.decode
    d0.behaviour.status = 500  # answers, so it stays healthy and in the rotation
    first = c.post(prompt="x")
    assert first.status_code == 200 and first.content == d1.answers[-1]  # the one retry
    # The retry went to d1, so the rotation is back at d0: no retry left in the window.
    spent = c.post(prompt="y")
    assert spent.status_code == 500 and spent.content == d0.answers[-1]
    rec = c.record(spent.headers["x-kv-transfer-id"])
    assert (rec["attempts"], rec["retried_as"]) == (1, None)
    s = c.metrics()
    assert sample(s, "kvproxy_retries_total", stage="decode", reason="status_5xx") == 1
    assert sample(s, "kvproxy_retries_refused_total", stage="decode", why="budget") == 1


def test_a_spent_budget_leaves_a_refused_prefill_unretried(
    make_cluster: Callable[..., Cluster],
) -> None:
    c = make_cluster(n_prefill=2, n_decode=1).start_proxy(
        prefill_policy="round_robin", retry_budget_ratio=0.0, retry_budget_min=0
    )
    p0, p1 = c.prefill
    p0.stop()
    c.decode[0].behaviour.prefill_wait_s = 0.2
    rec = c.record(c.post(prompt="x").headers["x-kv-transfer-id"])
    assert (rec["status"], rec["attempts"], rec["prefill"]) == ("prefill_failed", 1, p0.url)
    assert not p1.requests
    s = c.metrics()
    assert sample(s, "kvproxy_retries_refused_total", stage="prefill", why="budget") == 1
