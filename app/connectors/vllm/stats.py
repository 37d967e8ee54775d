"""Transfer stats of ``KVSidecarConnector`` for vLLM's log line and its ``/metrics``.

Each worker rank records, per request its sidecar reports ended (``Finished.totals``), one row:
direction (``send`` on prefill, ``recv`` on decode), outcome, the bytes that rank moved and the
seconds from the rank's admission to the final state (what the sidecar's ``/v1/requests``
shows as ``bytes`` and ``duration_s``). Decode requests the sidecar never took (the scheduler's
``failed_recvs``) are failed rows of 0 bytes.

Across TP ranks a request is one transfer: vLLM gathers every rank's rows (``aggregate``), and
rows of the same request and direction merge into one: bytes are summed over ranks (each rank
moves its own heads), the time is the slowest rank's (the request waits for all of them), and
the outcome is the worst (failed, then expired, then done: DONE only where every rank was).
Ranks can report one request in different engine steps, so ``KVSidecarPromMetrics`` holds a
partial request until all of its ranks (the engine's TP size) reported before counting it;
bytes are counted as each rank reports them. vLLM's periodic log line merges rows within its
interval only.

Decode's bytes are what its senders' ``Done`` said, as in ``/v1/requests``: each ``Done``
carries the bytes written to that decode rank, so with any TP pairing both sides add up to
the same total.

Prometheus (each with vLLM's ``model_name`` and ``engine`` labels and ``direction``):
``vllm:kv_sidecar_transfers_total`` (ended DONE), ``vllm:kv_sidecar_failed_transfers_total``
(FAILED or ABORTED: the KV did not arrive), ``vllm:kv_sidecar_expired_transfers_total``
(EXPIRED at the deadline), ``vllm:kv_sidecar_bytes_transferred_total`` (every outcome) and the
histogram ``vllm:kv_sidecar_transfer_time_seconds`` (DONE transfers).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)

from app.engine_link.client import FinishedRequests
from app.transfer.wire.protocol import Status

log = logging.getLogger(__name__)

Side = Literal["send", "recv"]
Outcome = Literal["done", "expired", "failed"]
SIDES: tuple[Side, ...] = ("send", "recv")
_WORSE: dict[str, int] = {"done": 0, "expired": 1, "failed": 2}
# Partial requests held for their other ranks; past this, ranks that never reported (a dead
# worker) would grow the map forever, so the oldest is dropped.
MAX_PARTIAL = 4096
TIME_BUCKETS = [0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]


def outcome(status: Status) -> Outcome:
    if status is Status.DONE:
        return "done"
    return "expired" if status is Status.EXPIRED else "failed"


@dataclass(frozen=True)
class Transfer:
    """One request in one direction: one rank's report, or several merged."""

    side: Side
    request: str
    outcome: Outcome
    bytes: int
    seconds: float
    ranks: int  # rank reports merged into this one
    of: int  # rank reports that make the request whole (the reporting engine's TP size)

    @property
    def whole(self) -> bool:
        return self.ranks >= self.of

    @property
    def key(self) -> tuple[str, str]:
        return self.side, self.request

    def merge(self, other: Transfer) -> Transfer:
        worst = max(self.outcome, other.outcome, key=_WORSE.__getitem__)
        return replace(
            self,
            outcome=worst,
            bytes=self.bytes + other.bytes,
            seconds=max(self.seconds, other.seconds),
            ranks=self.ranks + other.ranks,
        )


def merged(rows: Iterable[Transfer]) -> list[Transfer]:
    """Rows of the same request and direction merged into one (first-seen order)."""
    out: dict[tuple[str, str], Transfer] = {}
    for t in rows:
        seen = out.get(t.key)
        out[t.key] = t if seen is None else seen.merge(t)
    return list(out.values())


@dataclass
class KVSidecarStats(KVConnectorStats):
    """Rows of ``Transfer`` as plain dicts (the data crosses processes as msgpack and pickle).

    Recorded and taken on the worker's model-runner thread only (``get_finished`` and
    ``get_kv_connector_stats`` run there in turn), so no lock."""

    ranks: int = field(default=1)  # this engine's TP size: rank reports per request

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = {"transfers": [], "skipped": {}}

    def skipped(self, reasons: Iterable[str]) -> None:
        """Requests that went without the KV pool or a transfer (rank 0 records them)."""
        counts = self.data.setdefault("skipped", {})
        for reason in reasons:
            counts[reason] = counts.get(reason, 0) + 1

    def transfers(self) -> list[Transfer]:
        return [Transfer(**row) for row in self.data.get("transfers", [])]

    def record(self, fin: FinishedRequests, failed_recvs: Iterable[str] = ()) -> None:
        """This rank's requests the sidecar reported ended, and decode requests it never took
        (ids in ``failed_recvs`` without a sidecar report)."""
        rows = [
            Transfer(t.side, t.request, outcome(t.status), t.bytes, t.duration_s, 1, self.ranks)
            for t in fin.totals
        ]
        reported = {t.request for t in fin.totals}
        rows += [
            Transfer("recv", rid, "failed", 0, 0.0, 1, self.ranks)
            for rid in sorted(set(failed_recvs) - reported)
        ]
        self.data["transfers"].extend(asdict(t) for t in rows)

    def take(self) -> KVSidecarStats | None:
        """The rows since the last call (None if there are none); this object starts over."""
        if self.is_empty():
            return None
        snapshot = KVSidecarStats(data=self.data, ranks=self.ranks)
        self.reset()
        return snapshot

    def is_empty(self) -> bool:
        return not self.data.get("transfers") and not self.data.get("skipped")

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        assert isinstance(other, KVSidecarStats), type(other)
        rows = merged([*self.transfers(), *other.transfers()])
        skipped = dict(self.data.get("skipped") or {})
        for reason, n in (other.data.get("skipped") or {}).items():
            skipped[reason] = skipped.get(reason, 0) + n
        self.data = {"transfers": [asdict(t) for t in rows], "skipped": skipped}
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {
            f"skipped ({reason})": n for reason, n in (self.data.get("skipped") or {}).items()
        }
        rows = self.transfers()
        for side in SIDES:
            mine = [t for t in rows if t.side == side]
            if not mine:
                continue
            done = np.asarray([t.seconds for t in mine if t.outcome == "done"], dtype=np.float64)
            out[f"{side} transfers"] = int(done.size)
            out[f"{side} failed"] = sum(t.outcome == "failed" for t in mine)
            out[f"{side} expired"] = sum(t.outcome == "expired" for t in mine)
            out[f"{side} MB"] = round(sum(t.bytes for t in mine) / 2**20, 3)
            out[f"{side} avg time (ms)"] = round(float(done.mean()) * 1e3, 3) if done.size else 0
            out[f"{side} p90 time (ms)"] = (
                round(float(np.percentile(done, 90)) * 1e3, 3) if done.size else 0
            )
        return out


class KVSidecarPromMetrics(KVConnectorPromMetrics):
    """The connector's Prometheus metrics, one child per (engine, direction)."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        names = [*labelnames, "direction"]

        def counter(name: str, doc: str) -> dict[tuple[int, str], Any]:
            return self._children(self._counter_cls(name=name, documentation=doc, labelnames=names))

        self.transfers = counter(
            "vllm:kv_sidecar_transfers",
            "KV transfers through the kv-sidecar that ended DONE on every rank.",
        )
        self.failed = counter(
            "vllm:kv_sidecar_failed_transfers",
            "KV transfers through the kv-sidecar that failed or were aborted on some rank.",
        )
        self.expired = counter(
            "vllm:kv_sidecar_expired_transfers",
            "KV transfers through the kv-sidecar that expired at their deadline on some rank.",
        )
        self.bytes = counter(
            "vllm:kv_sidecar_bytes_transferred",
            "Bytes of KV moved through the kv-sidecar, summed over ranks, every outcome.",
        )
        histogram: Any = self._histogram_cls  # vLLM types it as any metric class
        self.time = self._children(
            histogram(
                name="vllm:kv_sidecar_transfer_time_seconds",
                documentation="Seconds from admission at the sidecar to DONE, slowest rank "
                "(decode: includes waiting for the prefill, which pushes while it computes).",
                buckets=TIME_BUCKETS,
                labelnames=names,
            )
        )
        self._partial: dict[tuple[int, str, str], Transfer] = {}
        self._skipped: Any = self._counter_cls(
            name="vllm:kv_sidecar_skipped_requests",
            documentation="Requests that went without the KV pool or a KV transfer, by reason "
            "(prompt_embeds: nothing to key or move; unkeyable_extra_key: a key vLLM added that "
            "the pool cannot name).",
            labelnames=[*labelnames, "reason"],
        )

    def _children(self, metric: Any) -> dict[tuple[int, str], Any]:
        return {
            (idx, side): metric.labels(*values, side)
            for idx, values in self.per_engine_labelvalues.items()
            for side in SIDES
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        values = self.per_engine_labelvalues[engine_idx]
        for reason, n in (transfer_stats_data.get("skipped") or {}).items():
            self._skipped.labels(*values, reason).inc(n)
        for row in transfer_stats_data.get("transfers", []):
            t = Transfer(**row)
            self.bytes[engine_idx, t.side].inc(t.bytes)
            key = (engine_idx, t.side, t.request)
            held = self._partial.pop(key, None)
            t = t if held is None else held.merge(t)
            if not t.whole:
                self._partial[key] = t
                if len(self._partial) > MAX_PARTIAL:
                    lost = self._partial.pop(next(iter(self._partial)))
                    log.warning("dropping stats of %s: not every rank reported it", lost.request)
                continue
            if t.outcome == "done":
                self.transfers[engine_idx, t.side].inc()
                self.time[engine_idx, t.side].observe(t.seconds)
            elif t.outcome == "expired":
                self.expired[engine_idx, t.side].inc()
            else:
                self.failed[engine_idx, t.side].inc()
