"""The sidecar's state for one engine rank: its layout, its requests, its stream thread.

Send side (prefill): a request is admitted with D's block ids, planned layer by layer on the
stream thread as the engine signals layers, and ends DONE when every D rank it wrote to acked its
``Done``; FAILED on a write error, a nack or a missing ack; ABORTED; or EXPIRED at its deadline.
Receive side (decode): a request is expected with its manifest (which P ranks deliver which
groups), and ends DONE when every sender reported OK, FAILED when one reported a failure,
ABORTED, or EXPIRED at its deadline. Either way the engine hears of it exactly once.

A deadline follows progress (``Request.progressed``): a transfer whose prefill still computes
and writes chunk after chunk never expires, however long its prompt; one that stops making
progress expires after its idle bound, and every one at its absolute cap (``transfer_max_s``).
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from app.devices.bell import Bell
from app.devices.events import Gate, SidecarRing
from app.devices.memory import ImportedMemory
from app.errors import ProtocolError
from app.kvcache.desc import LayoutDesc
from app.kvcache.digest import DigestMismatch, DigestState, KvMemory
from app.kvcache.engine_spec import EngineRegistration
from app.kvcache.layout import RankLayout
from app.transfer.planning.planner import MambaMode
from app.transfer.planning.tp_mapping import senders
from app.transfer.requests.stream import StreamThread
from app.transfer.requests.timeline import SendTimeline, StepLog
from app.transfer.wire.protocol import FailedRequest, RequestTotals, Status

log = logging.getLogger(__name__)

Blocks = tuple[np.ndarray, ...]

# Guards request state against the stream threads' pins: a write starts only on a live request.
_STATE_LOCK = threading.Lock()

# Refusals held for an engine that stopped polling get_finished; past it they are only logged.
_MAX_REFUSED = 4096


def receive_manifest(local: LayoutDesc, prefill_tp: int) -> dict[int, frozenset[int]]:
    """P rank -> groups it must deliver to this D rank (pure; from both TP sizes)."""
    out: dict[int, set[int]] = {}
    kinds = {r.group: r.kind for r in local.regions}
    for pl in local.placements:
        for pc in pl.pieces:
            for p in senders(
                kinds[pl.group],
                local.rank,
                pc.unit_first,
                pc.unit_count,
                pc.units,
                prefill_tp,
                local.tp,
            ):
                out.setdefault(p, set()).add(pl.group)
    return {p: frozenset(g) for p, g in out.items()}


@dataclass
class GroupProgress:
    layers_sent: int = 0
    bytes: int = 0
    descriptors: int = 0


@dataclass
class Request:
    """Common to both sides."""

    id: str
    rank: int
    prompt_len: int
    blocks: Blocks
    deadline: float
    peer: str
    created: float = field(default_factory=time.monotonic)
    state: Status = Status.PENDING
    error: str = ""
    bytes: int = 0
    reported: bool = False
    reported_at: float | None = None  # handed back to the engine (get_finished): unpinned
    finished_at: float | None = None
    groups: dict[int, GroupProgress] = field(default_factory=dict)
    traceparent: str | None = None  # W3C trace context the engine passed (README "Tracing")
    # The KV digest (issue 51): "off" (none computed), send "sent", recv "ok" (every Done's
    # digests matched so far), "mismatch" (bytes differed: ``digest_mismatch``) or "refused"
    # (a digest run outside the request's blocks, or malformed).
    digest: DigestState = "off"
    digest_mismatch: DigestMismatch | None = None
    # Send: ms its Done waited for the digest; recv: ms the check of its Dones' digests took.
    digest_ms: float | None = None
    # Layers decode checked as they landed, before Done (``LayerDigests``): send, those decode
    # confirmed; recv, those it checked.
    digest_early_layers: int = 0
    digest_early_ms: float = 0.0  # recv: the time those checks took (off the critical path)
    digest_early_checks: int = 0  # recv: the LayerDigests messages those layers came in
    # Progress pushes ``deadline`` to ``idle_s`` past it, never beyond ``cap`` (absolute,
    # ``transfer_max_s`` from the transfer's start). Until then ``deadline`` is the wait it
    # was admitted with (decode's claim, prefill's target).
    idle_s: float = 0.0
    cap: float = math.inf
    progressed_at: float | None = None
    # The agent's ``ring``: moves the engine's finished bell when this request may have become
    # reportable (app.devices.bell).
    bell: Callable[[], None] | None = field(default=None, repr=False)

    def ring(self) -> None:
        if self.bell is not None:
            self.bell()

    def progressed(self, now: float) -> None:
        """Progress came (a chunk scheduled, a layer signalled or written, a claim, a Done, a
        heartbeat naming it): the idle bound runs from ``now``."""
        if self.state.terminal or self.idle_s <= 0:
            return
        self.progressed_at = now
        self.deadline = min(now + self.idle_s, self.cap)

    def at_cap(self) -> bool:
        """Whether the deadline is the absolute cap (the expiry then names transfer_max_s)."""
        return self.deadline >= self.cap

    def finish(self, state: Status, error: str = "") -> bool:
        """Move to a terminal state once; later calls are ignored (first cause wins)."""
        with _STATE_LOCK:
            if self.state.terminal:
                return False
            self.state, self.error = state, error
        self.finished_at = time.monotonic()
        self.ring()
        return True


@dataclass
class SendRequest(Request):
    d_blocks: Blocks = ()
    target_epoch: str = ""
    mamba_mode: MambaMode = MambaMode.NONE
    num_spec: int = 0
    final_layers_left: int = -1
    final_step: int = -1  # the step that carries the prompt's last tokens (and the states)
    inflight: int = 0  # writes of this request on the wire right now (the pin)
    d_ranks: dict[int, frozenset[int]] = field(default_factory=dict)
    peer_lost: bool = False  # decode is gone or forgot us: no Done to send
    skip: int = 0  # prompt tokens decode already holds: never written
    prompt_digest: str = ""  # the prompt the engine runs: a target must be signed for it
    d_bytes: dict[int, int] = field(default_factory=dict)  # bytes written per D rank
    # Admitted without a target (concurrent dispatch): until it is claimed at decode, nothing
    # is written and the signalled layers are kept in ``backlog``.
    waiting: bool = False
    backlog: list[Held] = field(default_factory=list)
    # Each layer of each step: signalled, written, landed (admin API, traces).
    timeline: SendTimeline = field(default_factory=SendTimeline)
    # The KV digest's layers made while later ones were computed (``final_layer_written``).
    last_final_layer: int | None = None
    early_digests: dict[int, asyncio.Future[Any]] = field(default_factory=dict)
    # Layers digested early whose message to decode is not yet sent (the batch being filled).
    early_open: dict[int, asyncio.Future[Any]] = field(default_factory=dict)

    @property
    def held(self) -> bool:
        """Admitted without a target and none taken yet: its blocks wait on decode."""
        return self.waiting and not self.peer and not self.state.terminal

    @property
    def block_count(self) -> int:
        return sum(int(ids.size) for ids in self.blocks)

    def pin(self) -> bool:
        """Before a write: count it, unless the request already ended. Atomic with ``finish``,
        so once a request is terminal, ``inflight`` only goes down."""
        with _STATE_LOCK:
            if self.state.terminal:
                return False
            self.inflight += 1
            return True

    def unpin(self) -> None:
        with _STATE_LOCK:
            self.inflight -= 1
            last = self.inflight == 0 and self.state.terminal
        if last:  # the engine may have its blocks back now
            self.ring()


@dataclass
class RecvRequest(Request):
    manifest: dict[int, frozenset[int]] = field(default_factory=dict)
    delivered: dict[int, Status] = field(default_factory=dict)
    senders: dict[int, str] = field(default_factory=dict)  # P rank -> engine id that claimed it
    # The writes' idle bound (``idle_s``) runs from the first claim; until then the deadline is
    # the wait for a prefill to start the request (``claimed_at`` None).
    timeout_s: float = 0.0
    queue_timeout_s: float = 0.0
    claimed_at: float | None = None
    # Ended, but a sender may still be writing into the blocks: not reported to the engine
    # until every sender answered that it drained, or was declared lost.
    quarantined_at: float | None = None


@dataclass
class GroupStats:
    transfers_ok: int = 0
    transfers_failed: int = 0
    bytes: int = 0
    descriptors: int = 0
    layers_sent: int = 0
    done: int = 0


@dataclass
class StepState:
    """A forward step's request slices and the layers the engine has signalled so far."""

    slices: list[tuple[str, int, int]]
    seen: set[int] = field(default_factory=set)


@dataclass(frozen=True)
class Held:
    """A layer signalled for a send that had no target yet: written once it has one."""

    step: int
    layer: int
    start: int
    end: int
    gate: Gate


R = TypeVar("R", SendRequest, RecvRequest)


class Agent:
    """One engine rank's KV cache, requests and counters."""

    def __init__(self, layout: RankLayout | None, desc: LayoutDesc, engine_id: str) -> None:
        self.layout = layout  # None when the engine registered its own tensors
        self.memory: Sequence[object] = ()  # mappings of engine memory kept alive with the agent
        self.device_memory: list[ImportedMemory] = []  # device buffers imported from the engine
        # The engine's memory as the KV digest reads it (None: the sidecar owns it, no digest).
        self.digest_memory: KvMemory | None = None
        self.events: SidecarRing | None = None  # the rank's event ring, when it registered one
        self.bell: Bell | None = None  # the engine's finished bell, when it could be mapped
        self.registration: EngineRegistration | None = None
        self.desc = desc
        self.engine_id = engine_id
        self.rank = desc.rank
        self.sends: dict[str, SendRequest] = {}
        self.recvs: dict[str, RecvRequest] = {}
        self.steps: dict[int, StepState] = {}
        self.step_log = StepLog()  # recent steps and the rank's layer-signal totals
        # Admissions refused before a record existed (one-way BeginStep): reported as failed
        # by the next ``finished``.
        self.refused: list[FailedRequest] = []
        self.groups = {g.index: GroupStats() for g in desc.groups}
        self.stream: StreamThread | None = None
        self.epoch = ""  # the sidecar epoch (generation) this registration belongs to
        self.history: list[Request] = []  # recently ended, for the admin API
        # (side, terminal state) -> requests reported to the engine, for metrics.
        self.terminal: dict[tuple[str, Status], int] = {}

    def ring(self) -> None:
        """Something may be reportable now: the engine's next ``get_finished`` asks for it."""
        if self.bell is not None:
            self.bell.ring()

    def request(self, rid: str) -> Request | None:
        return self.sends.get(rid) or self.recvs.get(rid)

    def recent(self, rid: str, kind: type[R]) -> R | None:
        """A request in flight, or ended and reported not long ago (for repeated messages)."""
        req = (self.sends if kind is SendRequest else self.recvs).get(rid)
        if isinstance(req, kind):
            return req
        return next(
            (r for r in reversed(self.history) if r.id == rid and isinstance(r, kind)), None
        )

    def held_sends(self) -> list[SendRequest]:
        """Sends waiting for decode's target (prefill first, concurrent dispatch)."""
        return [r for r in list(self.sends.values()) if r.held]

    def all_requests(self) -> list[Request]:
        return [*self.sends.values(), *self.recvs.values()]

    def retire(self) -> None:
        """The engine that registered this rank is gone: its requests (ended by the caller) go
        to the history unreported, since nobody is left to tell."""
        for table in (self.sends, self.recvs):
            self.history.extend(table.values())
            table.clear()
        del self.history[:-256]

    def finished(self) -> tuple[list[str], list[str], list[FailedRequest]]:
        """Terminal requests not yet reported, unpinned; each is reported once."""
        sending: list[str] = []
        recving: list[str] = []
        failed: list[FailedRequest] = []
        for table, done in ((self.sends, sending), (self.recvs, recving)):
            for rid, req in list(table.items()):
                if not req.state.terminal:
                    continue
                if isinstance(req, SendRequest) and req.inflight:
                    # Our blocks are still read from, even by a write to a lost peer: the
                    # engine gets them back once Mooncake confirmed or failed it.
                    continue
                if isinstance(req, RecvRequest) and req.quarantined_at is not None:
                    continue
                if req.state is Status.DONE:
                    done.append(rid)
                else:
                    failed.append(
                        FailedRequest(rid, req.state, [b.tolist() for b in req.blocks], req.error)
                    )
                req.reported, req.reported_at = True, time.monotonic()
                key = ("send" if isinstance(req, SendRequest) else "recv", req.state)
                self.terminal[key] = self.terminal.get(key, 0) + 1
                del table[rid]
                self.history.append(req)
        del self.history[:-256]
        failed += self.refused
        self.refused = []
        return sending, recving, failed

    def refusal(
        self,
        rid: str,
        block_ids: list[list[int]],
        *,
        admitting: bool,
        held: Mapping[str, Request],
        known: str,
        report: bool,
        over: str = "",
    ) -> str:
        """Why a new send or receive ``rid`` is refused before it has a record ("" if it is
        not): the sidecar stops admitting, or ``held`` (this rank's sends or receives) has it
        already, ``known`` saying how, or it would go ``over`` a limit (the caller's sentence).
        With ``report`` (a one-way admission) the engine hears of the refusal as a failed
        request in its next ``finished``."""
        if not admitting:
            error = "sidecar is shutting down; not admitting requests"
        elif rid in held:
            error = f"request {rid} is {known}"
        elif over:
            error = over
        else:
            return ""
        if report and len(self.refused) < _MAX_REFUSED:
            self.refused.append(FailedRequest(rid, Status.FAILED, block_ids, error))
            self.ring()
        elif report:
            log.error("rank %d: refusal of %s not reported (%s)", self.rank, rid, error)
        return error

    def reported(
        self, sending: list[str], recving: list[str], failed: list[FailedRequest]
    ) -> list[Request]:
        """The requests ``finished`` just reported."""
        found: list[Request | None] = [self.recent(rid, SendRequest) for rid in sending]
        found += [self.recent(rid, RecvRequest) for rid in recving]
        found += [
            self.recent(f.request, SendRequest) or self.recent(f.request, RecvRequest)
            for f in failed
        ]
        return [r for r in found if r is not None]

    def totals(
        self, sending: list[str], recving: list[str], failed: list[FailedRequest]
    ) -> list[RequestTotals]:
        """Bytes and duration of each request ``finished`` just reported (for engine stats)."""
        return [
            RequestTotals(
                request=r.id,
                side="send" if isinstance(r, SendRequest) else "recv",
                status=r.state,
                bytes=r.bytes,
                duration_s=max(0.0, (r.finished_at or r.created) - r.created),
            )
            for r in self.reported(sending, recving, failed)
        ]


def agent_of(agents: dict[int, Agent], rank: int) -> Agent:
    """The agent of ``rank``, or a ProtocolError the engine can act on."""
    agent = agents.get(rank)
    if agent is None:
        raise ProtocolError(f"rank {rank} has not registered its KV caches with this sidecar")
    return agent


def blocks(ids: Sequence[Sequence[int]]) -> Blocks:
    """Block ids per group off the wire, as arrays."""
    return tuple(np.asarray(x, dtype=np.int64) for x in ids)
