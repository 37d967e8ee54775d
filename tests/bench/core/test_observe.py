"""What ``bench pd`` reads after a trial: the sidecar's per-layer timeline, Mooncake's events,
decode's per-step log lines. No engines, no sidecars: their records as the APIs give them."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from app.bench.core.observe import (
    ITERATION_LOG_FORMAT,
    LogTail,
    ended_within,
    engine_logging_config,
    mooncake_transfers,
    sidecar_timeline,
)
from app.bench.core.stats import parse_iterations

T = 1_764_237_600.0  # a Unix time


def _layer(step: int, layer: int, signalled: float, landed: float | None) -> dict[str, Any]:
    return {
        "step": step,
        "layer": layer,
        "group": 0,
        "signalled_at": T + signalled,
        "at_step_end": False,
        "submitted_at": T + signalled + 0.001,
        "landed_at": None if landed is None else T + landed,
        "bytes": 1 << 20,
    }


def _send(layers: list[dict[str, Any]], steps: list[dict[str, Any]]) -> dict[str, Any]:
    return {"id": "r1", "side": "send", "state": "DONE", "layers": layers, "steps": steps}


def test_timeline_landed_forward_end_and_d_done() -> None:
    steps = [
        {
            "step": 3,
            "began_at": T,
            "forward_ended_at": T + 1.0,
            "layers_in_forward": 3,
            "layers_at_step_end": 1,
        },
    ]
    layers = [_layer(3, i, 0.2 * (i + 1), 0.2 * (i + 1) + 0.011) for i in range(4)]
    recvs = [
        {"id": "r1", "side": "recv", "state": "DONE", "ended_at": T + 0.9},
        {"id": "r0", "side": "recv", "state": "EXPIRED", "ended_at": T + 5},  # not a landing
    ]
    tl = sidecar_timeline([_send(layers, steps)], recvs)
    assert tl["kv_landed"] == pytest.approx(T + 0.811)
    assert tl["first_landed"] == pytest.approx(T + 0.211)
    assert tl["last_signalled"] == pytest.approx(T + 0.8)
    assert tl["forward_began"] == pytest.approx(T)
    assert tl["forward_end"] == pytest.approx(T + 1.0)
    assert tl["d_done"] == pytest.approx(T + 0.9)
    assert tl["layer_write_s"] == pytest.approx(0.010, abs=1e-6)
    assert (tl["layers"], tl["layers_landed"]) == (4, 4)
    assert (tl["layers_in_forward"], tl["layers_at_step_end"]) == (3, 1)


def test_timeline_of_a_push_that_did_not_all_land() -> None:
    layers = [_layer(1, 0, 0.1, 0.2), _layer(1, 1, 0.3, None)]
    tl = sidecar_timeline([_send(layers, [])], [])
    assert tl["kv_landed"] is None  # not every layer landed: no landing time to report
    assert tl["first_landed"] == pytest.approx(T + 0.2)
    assert tl["forward_end"] is None and tl["d_done"] is None
    assert sidecar_timeline([], [])["layer_write_s"] is None


def test_records_of_a_trial_are_those_that_ended_in_it() -> None:
    rows = [
        {"id": "a", "ended_at": T - 1},  # the previous trial's
        {"id": "b", "ended_at": T + 1},
        {"id": "c", "ended_at": None},  # still in flight: no landing yet
    ]
    assert [r["id"] for r in ended_within(rows, T, T + 2)] == ["b"]


def test_mooncake_events_in_the_window(tmp_path: Path) -> None:
    events = tmp_path / "ev.jsonl"
    rows = [
        {"ev": "p_finished", "t": T + 0.5, "req": "x"},
        {"ev": "sent", "t": T + 0.6, "bytes": 1000},
        {"ev": "d_landed", "t": T + 0.7, "req": "x"},
        {"ev": "sent", "t": T + 9, "bytes": 5},  # later trial
    ]
    events.write_text("".join(json.dumps(r) + "\n" for r in rows))
    m = mooncake_transfers(events, T, T + 1)
    assert m["bytes"] == 1000 and m["landed"] == [T + 0.7] and m["p_finished"] == [T + 0.5]
    assert m["timeline"] is None
    assert mooncake_transfers(tmp_path / "none.jsonl", T, T + 1)["landed"] == []


def test_vllm_iteration_lines_with_the_bench_format_parse_back(tmp_path: Path) -> None:
    """vLLM's own stats logger writes the line; the format the bench gives the engines stamps
    it; the parser reads the computed tokens back."""
    loggers = pytest.importorskip("vllm.v1.metrics.loggers")
    stats = pytest.importorskip("vllm.v1.metrics.stats")
    config = engine_logging_config()
    assert config["formatters"]["bench"]["format"] == ITERATION_LOG_FORMAT
    assert config["loggers"]["vllm.v1.metrics.loggers"]["level"] == "INFO"
    assert config["loggers"]["vllm"]["level"] == "WARNING"
    log = tmp_path / "vllm-decode.log"
    handler = logging.FileHandler(log)
    handler.setFormatter(logging.Formatter(ITERATION_LOG_FORMAT))
    logger = logging.getLogger("vllm.v1.metrics.loggers")
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        details = stats.SchedulerIterationDetails(
            iteration_index=5,
            num_ctx_requests=2,
            num_ctx_tokens=1025,
            num_generation_requests=1,
            num_generation_tokens=1,
            elapsed_ms=3.0,
        )
        fake = SimpleNamespace(
            kv_cache_device="CPU", _log_prefix_for_engine=lambda _i: "Engine 000: "
        )
        sched = SimpleNamespace(iteration_details=details, kv_cache_usage=0.1)
        loggers.LoggingStatLogger._log_iteration_details(fake, sched, 0)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
        handler.close()
    tail = LogTail(log)
    found = tail.between(0, 2**40)
    assert len(found) == 1
    it = found[0]
    assert (it.context_requests, it.context_tokens) == (2, 1025)
    assert (it.generation_requests, it.generation_tokens) == (1, 1)
    assert parse_iterations(log.read_text()) == found


def test_log_tail_reads_only_what_was_added_and_waits_for_whole_lines(tmp_path: Path) -> None:
    log = tmp_path / "engine.log"
    line = (
        "{t:.6f} INFO vllm.v1.metrics.loggers: Iteration(1): 1 context requests, {n} context "
        "tokens, 0 generation requests, 0 generation tokens, ...\n"
    )
    tail = LogTail(log)
    assert tail.between(0, 2**40) == []  # no file yet
    log.write_text(line.format(t=T, n=1))
    full = line.format(t=T + 1, n=512)
    with log.open("a") as f:
        f.write(full[:40])  # a line being written
    assert [i.context_tokens for i in tail.between(0, 2**40)] == [1]
    with log.open("a") as f:
        f.write(full[40:])
    assert [i.context_tokens for i in tail.between(0, 2**40)] == [1, 512]
    assert [i.context_tokens for i in tail.between(T + 0.5, T + 2)] == [512]
