"""Per-transfer timings and outcomes, kept for operators (``GET /v1/transfers``)."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Literal

from app.proxy.dp import dp_rank
from app.proxy.retries import Retry
from app.proxy.routing import Pick
from app.tracing.traceparent import TraceParent

DecodeOutcome = Literal["ok", "failed", "unreachable", "timeout", "broken", "client_gone"]
PrefillOutcome = Literal[
    "ok",
    "prefill_failed",
    "send_failed",
    "target_timeout",
    "target_error",
    "no_target",
    "cancelled",
]
# A recompute whose decode connector said no reason it knows (an older connector, a load the
# scheduler refused before any transfer).
UNREPORTED = "unreported"


@dataclass(frozen=True)
class TransferRecord:
    """One request through the proxy, as ``/v1/transfers`` shows it (times in ms).

    ``status``: ``pending`` until both sides ended; then ``client_gone``, ``decode_failed``
    (decode answered non-200 or failed), ``recomputed`` (both answered, but decode's connector
    reported ``kv_load: "failed"``: the KV never came and decode computed the prompt itself),
    else the prefill side's outcome: ``ok``, ``prefill_failed``, ``send_failed`` (prefill
    answered, but its sidecar was gone and sent nothing), ``target_timeout``,
    ``target_error`` or ``no_target`` (decode ended before it posted a target, e.g. it had the
    whole prompt cached). A request served by decode alone (``disaggregated`` false,
    ``reason`` says why, ``prefill`` is None) ends ``local`` unless decode failed or the
    client left.

    ``kv_load`` is what decode's connector reported in its answer's ``kv_transfer_params``
    (``ok`` or ``failed``); None when it said nothing or the answer was streamed, which the
    proxy relays without reading: a streamed request whose KV never came shows ``ok``.
    ``recompute_reason``, only when ``recomputed``: why, as decode's connector said it
    (``kv_digest_mismatch``: the KV landed but its digest check failed at decode's sidecar;
    ``transfer_failed``: any other failed load), or ``unreported``.

    ``attempts``: the upstream tries this client request took so far (1 + ``retries``, which
    say what failed and why, retries.py). A prefill retry stays in its transfer; a decode
    retry starts a new transfer that carries the earlier retries, and the failed one names it
    in ``retried_as``.
    """

    transfer_id: str
    path: str
    decode: str
    prefill: str | None
    status: str
    target_ms: float | None
    prefill_ms: float | None
    total_ms: float | None
    decode_status: int | None
    prefill_status: int | None
    error: str | None
    started_at: float
    # Why each instance was picked (policy, tokens in flight, cache hits: README "Routing").
    decode_pick: Pick | None = None
    prefill_pick: Pick | None = None
    # Conditional disaggregation (README "Routing"): through prefill or not, and why.
    disaggregated: bool = True
    reason: str | None = None
    # The W3C trace this request belongs to (the client's, or one the proxy started).
    trace_id: str | None = None
    kv_load: str | None = None
    recompute_reason: str | None = None
    # The DP ranks that served it (instances named ``URL#dp<rank>``; None: no DP rank named).
    decode_dp_rank: int | None = None
    prefill_dp_rank: int | None = None
    attempts: int = 1
    retries: tuple[Retry, ...] = ()
    retried_as: str | None = None
    # Prefill failed for good: what decode's sidecar answered the proxy's abort (None: not told).
    decode_stop: str | None = None
    # A chat request: how its prompt was routed, ``ids from engine`` / ``ids from cache``
    # (both engines got the ids, chat_tokens.py) or ``text: <why>`` (None: not chat).
    chat_tokens: str | None = None
    # A stream's continuation (migration.py): the tokens the client had, and the decode that
    # broke off (None: not a continuation).
    migrated_at_token: int | None = None
    migrated_from: str | None = None


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 3)


@dataclass
class TransferTracker:
    """The live state of one transfer, filled in by the flow as events arrive."""

    transfer_id: str
    path: str
    decode: str
    prefill: str | None  # None: decode alone
    started: float = field(default_factory=time.monotonic)
    started_at: float = field(default_factory=time.time)
    target_s: float | None = None
    prefill_s: float | None = None
    total_s: float | None = None
    decode_status: int | None = None
    prefill_status: int | None = None
    decode_outcome: DecodeOutcome | None = None
    prefill_outcome: PrefillOutcome | None = None
    error: str | None = None
    decode_pick: Pick | None = None
    prefill_pick: Pick | None = None
    reason: str | None = None
    trace: TraceParent | None = None  # the proxy's server span: the calls' spans' parent
    kv_load: str | None = None  # decode's answer's kv_transfer_params.kv_load
    kv_load_error: str | None = None  # ...and its kv_load_error: why it failed
    counted: bool = False  # its final status is in kvproxy_transfers_total
    retries: tuple[Retry, ...] = ()  # this request's, the earlier transfers' included
    retried_as: str | None = None  # decode failed and the request went on as this transfer
    decode_stop: str | None = None  # what decode's sidecar answered the abort (decode_stop.py)
    chat_tokens: str | None = None  # a chat request's routing by ids or text (chat_tokens.py)
    migrated_at_token: int | None = None  # a stream's continuation (migration.py)
    migrated_from: str | None = None

    @property
    def disaggregated(self) -> bool:
        return self.prefill is not None

    def since_start(self) -> float:
        return time.monotonic() - self.started

    def note_error(self, message: str) -> None:
        """Keep the first error: later ones are usually its consequences."""
        if self.error is None:
            self.error = message

    @property
    def status(self) -> str:
        if self.decode_outcome is None or (self.disaggregated and self.prefill_outcome is None):
            return "pending"
        if self.decode_outcome == "client_gone":
            return "client_gone"
        if self.decode_outcome != "ok":
            return "decode_failed"
        if self.prefill_outcome == "ok" and self.kv_load == "failed":
            return "recomputed"
        return self.prefill_outcome or "local"

    @property
    def recompute_reason(self) -> str | None:
        """Why decode recomputed (None unless the status is ``recomputed``)."""
        if self.status != "recomputed":
            return None
        return self.kv_load_error or UNREPORTED

    def record(self) -> TransferRecord:
        return TransferRecord(
            transfer_id=self.transfer_id,
            path=self.path,
            decode=self.decode,
            prefill=self.prefill,
            status=self.status,
            target_ms=_ms(self.target_s),
            prefill_ms=_ms(self.prefill_s),
            total_ms=_ms(self.total_s),
            decode_status=self.decode_status,
            prefill_status=self.prefill_status,
            error=self.error,
            started_at=round(self.started_at, 3),
            decode_pick=self.decode_pick,
            prefill_pick=self.prefill_pick,
            disaggregated=self.disaggregated,
            reason=self.reason,
            trace_id=None if self.trace is None else self.trace.trace_id,
            kv_load=self.kv_load,
            recompute_reason=self.recompute_reason,
            decode_dp_rank=dp_rank(self.decode),
            prefill_dp_rank=None if self.prefill is None else dp_rank(self.prefill),
            attempts=1 + len(self.retries),
            retries=self.retries,
            retried_as=self.retried_as,
            decode_stop=self.decode_stop,
            chat_tokens=self.chat_tokens,
            migrated_at_token=self.migrated_at_token,
            migrated_from=self.migrated_from,
        )


class TransferLog:
    """The last ``size`` transfers, oldest first."""

    def __init__(self, size: int) -> None:
        self._items: deque[TransferTracker] = deque(maxlen=size)

    def start(
        self, transfer_id: str, path: str, decode: str, prefill: str | None
    ) -> TransferTracker:
        t = TransferTracker(transfer_id, path, decode, prefill)
        self._items.append(t)
        return t

    def records(self, limit: int | None = None) -> list[TransferRecord]:
        items = list(self._items)
        if limit is not None:
            items = items[-limit:] if limit > 0 else []
        return [t.record() for t in items]

    def get(self, transfer_id: str) -> TransferRecord | None:
        for t in reversed(self._items):
            if t.transfer_id == transfer_id:
                return t.record()
        return None
