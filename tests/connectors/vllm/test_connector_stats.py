"""The connector's transfer stats: how rows of TP ranks merge, and what vLLM's own ``/metrics``
shows for one request through a real P/D pair, against the sidecars' ``/v1/requests``.

Catches: bytes or time not recorded, a transfer counted once per rank (or per engine step)
instead of once per request, a direction or outcome mislabelled, stats lost crossing from the
worker to the API server (they travel as msgpack).
"""

from __future__ import annotations

import re
import time
from functools import partial
from types import SimpleNamespace
from typing import Any

import httpx
import msgspec
import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from app.connectors.local_pd import LocalPD
from app.connectors.vllm import KVSidecarConnector
from app.connectors.vllm.stats import KVSidecarPromMetrics, KVSidecarStats
from app.engine_link.client import FinishedRequests
from app.transfer.protocol import RequestTotals, Status
from tests.connectors.vllm.conftest import prompt

NAMES = {
    "transfers": "vllm:kv_sidecar_transfers_total",
    "failed": "vllm:kv_sidecar_failed_transfers_total",
    "expired": "vllm:kv_sidecar_expired_transfers_total",
    "bytes": "vllm:kv_sidecar_bytes_transferred_total",
    "time_count": "vllm:kv_sidecar_transfer_time_seconds_count",
    "time_sum": "vllm:kv_sidecar_transfer_time_seconds_sum",
}


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


def sample(text: str, name: str, direction: str) -> float:
    """The value of ``name`` for ``direction``, summed over its other labels (0 if absent)."""
    total = 0.0
    for m in re.finditer(rf"^{re.escape(name)}\{{([^}}]*)\}} (\S+)$", text, re.M):
        if f'direction="{direction}"' in m.group(1):
            total += float(m.group(2))
    return total


def test_prometheus_counts_a_request_once_all_ranks_reported() -> None:
    """Ranks of one request arriving in different engine steps: bytes counted at once, the
    transfer and its time once the last rank reported."""
    reg = CollectorRegistry()
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


# ---- real engines ---------------------------------------------------------------------------


def metrics(base: str) -> dict[str, float]:
    """Our metrics off an engine's vLLM ``/metrics``, by short name and direction."""
    text = httpx.get(f"{base}/metrics", timeout=10).text
    for name in NAMES.values():
        assert name in text, f"{name} missing from {base}/metrics"
    return {
        f"{key}/{d}": sample(text, name, d) for key, name in NAMES.items() for d in ("send", "recv")
    }


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in after}


def wait_counted(
    base: str, before: dict[str, float], key: str, timeout_s: float = 60
) -> dict[str, float]:
    """The metrics' change since ``before`` once ``key`` moved (stats arrive with engine steps)."""
    end = time.monotonic() + timeout_s
    while True:
        d = delta(metrics(base), before)
        if d[key] > 0 or time.monotonic() > end:
            return d
        time.sleep(0.2)


@pytest.mark.parametrize("pd", ["llama"], indirect=True)
def test_metrics_match_the_sidecars(pd: LocalPD) -> None:
    """One request through the proxy: prefill's /metrics counts one send, decode's one recv,
    each with the bytes and the time its sidecar's /v1/requests reports for that request."""
    p_before, d_before = metrics(pd.prefill.url), metrics(pd.decode.url)
    answer = pd.completion(pd.proxy, prompt(300, 3), 2)
    rid = answer["kv_transfer_params"]["kv_sidecar_request_id"]
    p = wait_counted(pd.prefill.url, p_before, "transfers/send")
    d = wait_counted(pd.decode.url, d_before, "transfers/recv")

    for base, got, side in ((pd.prefill.admin, p, "send"), (pd.decode.admin, d, "recv")):
        entries = httpx.get(f"{base}/v1/requests/{rid}", timeout=10).json()["entries"]
        mine = [e for e in entries if e["side"] == side]
        assert mine and all(e["state"] == "DONE" for e in mine), entries
        other = "recv" if side == "send" else "send"
        assert got[f"transfers/{side}"] == 1, got
        assert got[f"time_count/{side}"] == 1, got
        assert got[f"bytes/{side}"] == sum(e["bytes"] for e in mine) > 0, (got, mine)
        # The admin rounds to 0.1 ms; the metric is the slowest rank's.
        assert got[f"time_sum/{side}"] == pytest.approx(
            max(e["duration_s"] for e in mine), abs=2e-4
        ), (got, mine)
        assert got[f"failed/{side}"] == got[f"expired/{side}"] == 0, got
        assert got[f"transfers/{other}"] == got[f"bytes/{other}"] == 0, got
    # Both ends of the push agree on what moved.
    assert p["bytes/send"] == d["bytes/recv"]
