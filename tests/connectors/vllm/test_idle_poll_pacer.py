"""``IdlePollPacer``: no-forward steps' round trips spaced ``interval_s`` apart; forward steps
never wait (pure logic, a hand-moved clock; the real engine: test_idle_polls.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from vllm.config import KVTransferConfig

from app.connectors.vllm.config import ConnectorConfig
from app.connectors.vllm.pacing import IdlePollPacer
from app.connectors.vllm.scheduler import SchedulerSide
from app.errors import ConfigError


class Clock:
    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.slept.append(round(s, 6))
        self.now += s


def test_no_forward_steps_wait_out_the_interval_since_the_last_poll() -> None:
    c = Clock()
    p = IdlePollPacer(0.01, clock=c, sleep=c.sleep)
    assert p.due(forward=False)  # the first: nothing to space from
    assert c.slept == []
    c.now += 0.003
    assert p.due(forward=False)
    assert c.slept == [0.007]
    c.now += 0.02  # a step that took longer than the interval
    assert p.due(forward=False)
    assert c.slept == [0.007]


def test_forward_steps_never_wait_and_count_as_a_poll() -> None:
    c = Clock()
    p = IdlePollPacer(0.01, clock=c, sleep=c.sleep)
    assert p.due(forward=False)
    c.now += 0.001
    assert p.due(forward=True)
    assert c.slept == []
    c.now += 0.004
    assert p.due(forward=False)  # 4 ms after the forward step's poll
    assert c.slept == [0.006]


def test_zero_interval_never_waits() -> None:
    c = Clock()
    p = IdlePollPacer(0.0, clock=c, sleep=c.sleep)
    assert all(p.due(forward=False) for _ in range(3))
    assert c.slept == []


def test_a_data_parallel_rank_skips_instead_of_sleeping() -> None:
    c = Clock()
    p = IdlePollPacer(0.01, wait=False, clock=c, sleep=c.sleep)
    assert p.due(forward=False)
    c.now += 0.004
    assert not p.due(forward=False)  # skipped: the step ends at once
    c.now += 0.004
    assert not p.due(forward=False)
    c.now += 0.003  # 11 ms after the last round trip
    assert p.due(forward=False)
    assert c.slept == []


def engine_config(**extra: object) -> SimpleNamespace:
    transfer = KVTransferConfig(
        kv_connector="KVSidecarConnector",
        kv_role="kv_consumer",
        engine_id="d",
        kv_connector_extra_config={"sidecar": "ipc:///run/kvs/engine.ipc", **extra},
    )
    parallel = SimpleNamespace(
        tensor_parallel_size=1, pipeline_parallel_size=1, data_parallel_index=0
    )
    return SimpleNamespace(kv_transfer_config=transfer, parallel_config=parallel)


def test_interval_from_the_extra_config_in_ms() -> None:
    assert ConnectorConfig.from_vllm(engine_config()).idle_poll_s == 0.01
    assert ConnectorConfig.from_vllm(engine_config(idle_poll_interval_ms=2)).idle_poll_s == 0.002


@pytest.mark.parametrize("given", ["fast", -1, 5000])
def test_interval_out_of_range_is_refused(given: object) -> None:
    with pytest.raises(ConfigError, match="idle_poll_interval_ms"):
        ConnectorConfig.from_vllm(engine_config(idle_poll_interval_ms=given))


def step(scheduled: dict[str, int]) -> SimpleNamespace:
    """vLLM's scheduler output with these tokens scheduled per request, nothing new."""
    return SimpleNamespace(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[], new_block_ids=[]),
        num_scheduled_tokens=scheduled,
        total_num_scheduled_tokens=sum(scheduled.values()),
        preempted_req_ids=None,
    )


def test_the_scheduler_marks_the_steps_without_a_forward_pass() -> None:
    # Never dialled: building a step's metadata makes no sidecar call.
    side = SchedulerSide(ConnectorConfig("ipc:///nonexistent", "e", 1, 1, None, 1.0))
    assert side.build_connector_meta(step({"a": 1, "b": 0})).forward
    assert not side.build_connector_meta(step({})).forward
