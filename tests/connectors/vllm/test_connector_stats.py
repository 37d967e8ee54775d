"""The connector's transfer stats: how rows of TP ranks merge into one transfer per request
(``test_pd_e2e.py::test_metrics_match_the_sidecars`` reads them off a real pair's ``/metrics``).

Catches: bytes or time not recorded, a transfer counted once per rank (or per engine step)
instead of once per request, a direction or outcome mislabelled, stats lost crossing from the
worker to the API server (they travel as msgpack).
"""

from __future__ import annotations

from functools import partial
from types import SimpleNamespace
from typing import Any

import msgspec
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from app.connectors.vllm import KVSidecarConnector
from app.connectors.vllm.stats import KVSidecarPromMetrics, KVSidecarStats
from app.engine_link.client import FinishedRequests
from app.transfer.wire.protocol import RequestTotals, Status
from tests.connectors.vllm.vllm_metrics import NAMES, sample


def finished(*totals: tuple[str, str, Status, int, float]) -> FinishedRequests:
    """What a rank's sidecar answers get_finished with (only ``totals`` matters to stats)."""
    return FinishedRequests(
        [], [], [], totals=tuple(RequestTotals(r, s, st, b, d) for r, s, st, b, d in totals)
    )


def worker_stats(ranks: int, *totals: Any, failed_recvs: tuple[str, ...] = ()) -> KVSidecarStats:
    """One rank's stats as vLLM takes them after a step, through msgpack like across processes."""
    stats = KVSidecarStats(ranks=ranks)
    stats.record(finished(*totals), failed_recvs)
    taken = stats.take()
    assert taken is not None and stats.take() is None  # taken once, then empty
    data = msgspec.msgpack.decode(msgspec.msgpack.encode(taken.to_dict()))
    built = KVSidecarConnector.build_kv_connector_stats(data)
    assert isinstance(built, KVSidecarStats)
    return built


def test_ranks_merge_into_one_transfer_per_request() -> None:
    """Two TP ranks: bytes sum, the slowest rank's time, the worst outcome, one row each."""
    # "c": a load the sidecars failed (also in the worker's failed set); "d": one the scheduler
    # never got its sidecar to take (every rank hears of it, no sidecar report); "e": rank 1
    # has not reported it yet.
    rank0 = worker_stats(
        2,
        ("a", "send", Status.DONE, 100, 0.25),
        ("b", "send", Status.DONE, 10, 0.5),
        ("c", "recv", Status.FAILED, 0, 1.0),
        ("e", "recv", Status.DONE, 7, 0.1),
        failed_recvs=("c", "d"),
    )
    rank1 = worker_stats(
        2,
        ("a", "send", Status.DONE, 150, 0.75),
        ("b", "send", Status.EXPIRED, 0, 2.0),
        ("c", "recv", Status.FAILED, 0, 1.5),
        failed_recvs=("c", "d"),
    )
    agg = rank0.aggregate(rank1)
    assert isinstance(agg, KVSidecarStats)
    rows = {(t.side, t.request): t for t in agg.transfers()}
    assert sorted(rows) == [
        ("recv", "c"),
        ("recv", "d"),
        ("recv", "e"),
        ("send", "a"),
        ("send", "b"),
    ]
    a = rows["send", "a"]
    assert (a.outcome, a.bytes, a.seconds, a.ranks, a.whole) == ("done", 250, 0.75, 2, True)
    b = rows["send", "b"]
    assert (b.outcome, b.bytes, b.seconds, b.whole) == ("expired", 10, 2.0, True)
    c, d, e = rows["recv", "c"], rows["recv", "d"], rows["recv", "e"]
    assert (c.outcome, c.seconds, c.ranks) == ("failed", 1.5, 2)
    assert (d.outcome, d.bytes, d.ranks) == ("failed", 0, 2)
    assert (e.outcome, e.ranks, e.whole) == ("done", 1, False)
    assert agg.reduce() == {
        "send transfers": 1,
        "send failed": 0,
        "send expired": 1,
        "send MB": round(260 / 2**20, 3),
        "send avg time (ms)": 750.0,
        "send p90 time (ms)": 750.0,
        "recv transfers": 1,
        "recv failed": 2,
        "recv expired": 0,
        "recv MB": round(7 / 2**20, 3),
        "recv avg time (ms)": 100.0,
        "recv p90 time (ms)": 100.0,
    }
    # Aggregating across engine steps (vLLM's log interval) completes "e".
    later = agg.aggregate(worker_stats(2, ("e", "recv", Status.DONE, 9, 0.3)))
    assert isinstance(later, KVSidecarStats)
    e = {t.request: t for t in later.transfers()}["e"]
    assert (e.bytes, e.seconds, e.whole) == (16, 0.3, True)


def test_sidecar_report_is_not_counted_twice_as_refused() -> None:
    """A decode request the sidecar reported failed is also in the worker's failed set."""
    stats = worker_stats(1, ("x", "recv", Status.EXPIRED, 64, 3.0), failed_recvs=("x",))
    (row,) = stats.transfers()
    assert (row.outcome, row.bytes) == ("expired", 64)


def _prom(reg: CollectorRegistry) -> KVSidecarPromMetrics:
    """The connector's metrics as vLLM builds them, in ``reg``."""
    types: dict[Any, Any] = {
        Gauge: partial(Gauge, registry=reg),
        Counter: partial(Counter, registry=reg),
        Histogram: partial(Histogram, registry=reg),
    }
    vllm_config: Any = SimpleNamespace(kv_transfer_config=None)
    prom = KVSidecarConnector.build_prom_metrics(
        vllm_config, types, ["model_name", "engine"], {0: ["tiny", "0"]}
    )
    assert isinstance(prom, KVSidecarPromMetrics)
    return prom


def test_prometheus_counts_a_request_once_all_ranks_reported() -> None:
    """Ranks of one request arriving in different engine steps: bytes counted at once, the
    transfer and its time once the last rank reported."""
    reg = CollectorRegistry()
    prom = _prom(reg)
    prom.observe(worker_stats(2, ("a", "send", Status.DONE, 100, 0.25)).to_dict())
    text = generate_latest(reg).decode()
    assert sample(text, NAMES["bytes"], "send") == 100
    assert sample(text, NAMES["transfers"], "send") == 0
    prom.observe(worker_stats(2, ("a", "send", Status.DONE, 150, 0.75)).to_dict())
    prom.observe(worker_stats(2, ("e", "recv", Status.EXPIRED, 0, 5.0)).to_dict())
    prom.observe(worker_stats(2, ("e", "recv", Status.EXPIRED, 0, 5.0)).to_dict())
    text = generate_latest(reg).decode()
    assert sample(text, NAMES["bytes"], "send") == 250
    assert sample(text, NAMES["transfers"], "send") == 1
    assert sample(text, NAMES["time_count"], "send") == 1
    assert sample(text, NAMES["time_sum"], "send") == 0.75
    assert sample(text, NAMES["expired"], "recv") == 1
    assert sample(text, NAMES["transfers"], "recv") == 0
    assert sample(text, NAMES["failed"], "send") == sample(text, NAMES["failed"], "recv") == 0


def test_requests_without_the_pool_are_counted_by_reason() -> None:
    """The scheduler's skips (rank 0 records them) add up across aggregation and reach
    Prometheus as ``vllm:kv_sidecar_skipped_requests_total{reason}``."""
    a, b = KVSidecarStats(ranks=1), KVSidecarStats(ranks=1)
    a.skipped(["prompt_embeds", "prompt_embeds"])
    b.skipped(["unkeyable_extra_key"])
    assert not a.is_empty()
    merged_stats = a.aggregate(b)
    assert merged_stats.reduce() == {
        "skipped (prompt_embeds)": 2,
        "skipped (unkeyable_extra_key)": 1,
    }
    reg = CollectorRegistry()
    prom = _prom(reg)
    prom.observe(merged_stats.data)
    prom.observe(merged_stats.data)
    text = generate_latest(reg).decode()
    labels = 'engine="0",model_name="tiny",reason="prompt_embeds"'
    assert f"vllm:kv_sidecar_skipped_requests_total{{{labels}}} 4.0" in text, text
