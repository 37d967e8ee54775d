"""The decode side's request state machine: expect, accept claims, count Dones, quarantine.

A receive is expected with its manifest (which P ranks deliver which groups). A P rank claims
it before writing, naming decode's block ids, which must be the request's own. It ends DONE when
every sender reported OK, FAILED when one reported a failure or was lost, ABORTED, or EXPIRED:
no claim within ``recv_queue_timeout_s``, then, once claimed, nothing heard of prefill's
progress for ``recv_timeout_s`` (a claim, a ``Done``, a heartbeat naming it as still sent), or
``transfer_max_s`` from the claim, however it progressed.
When it ends any other way than DONE while a claimed sender may still be writing, it stays in
*quarantine* (ended, not reported to the engine, whose blocks stay allocated) until every such
sender answered the ``Abort`` that it has nothing on the wire, or its sidecar is gone, or
``quarantine_max_s`` passed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from asyncio import FIRST_COMPLETED
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from app.errors import OutOfBoundsError
from app.kvcache.digest import DigestVerdict
from app.transfer.control.peers import Peer, Peers
from app.transfer.planning.planner import check_block_ids
from app.transfer.requests.agent import Agent, RecvRequest, agent_of, blocks, receive_manifest
from app.transfer.requests.integrity import DigestStats, check_digests
from app.transfer.requests.send_ending import Spawn
from app.transfer.wire.protocol import (
    MAX_DEADLINE_S,
    Abort,
    Ack,
    AnyMsg,
    Claim,
    Done,
    ExpectRecv,
    LayerDigests,
    Msg,
    Reply,
    Status,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RecvSettings:
    """What the receive side reads of the sidecar's settings."""

    engine_id: str
    # Once claimed, a receive ends EXPIRED when nothing said prefill still sends it for this
    # long (the idle bound; each heartbeat of a prefill that still sends it says so).
    recv_timeout_s: float
    # The wait for a prefill's claim (None: recv_timeout_s). Under load a request waits in
    # prefill's queue before prefill claims it; a bound counted from decode's admission would
    # end it EXPIRED while prefill still holds it, and both engines would compute the prompt.
    recv_queue_timeout_s: float | None
    quarantine_max_s: float
    # how often a quarantine looks again for an overdue request or a vanished sender
    heartbeat_interval_s: float
    # A claimed receive ends EXPIRED this long after the claim, however prefill progresses.
    transfer_max_s: float = MAX_DEADLINE_S


class RecvSide:
    """Decode requests of every local rank."""

    def __init__(
        self,
        settings: RecvSettings,
        agents: dict[int, Agent],
        peers: Peers,
        *,
        spawn: Spawn,
        epoch: Callable[[], str],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``epoch()`` is this sidecar's current epoch (it changes with each generation)."""
        self._settings, self._agents, self._peers = settings, agents, peers
        self._spawn, self._epoch, self._clock = spawn, epoch, clock
        self.admitting = True
        self.counters = {"duplicate_dones": 0, "quarantined": 0, "refused_claims": 0}
        self.digests = DigestStats()
        # prefill engine id -> wakes its fence (``_hold``) when another request joins it
        self._fences: dict[str, asyncio.Event] = {}

    def expect(self, msg: ExpectRecv, *, report: bool = False) -> Msg:
        """Expect a receive. With ``report`` (a one-way ``BeginStep``) a refusal that leaves
        no record is reported to the engine in its next ``get_finished``."""
        agent = agent_of(self._agents, msg.rank)
        error = agent.refusal(
            msg.request,
            msg.block_ids,
            admitting=self.admitting,
            held=agent.recvs,
            known="already expected",
            report=report,
        )
        if error:
            return Reply(ok=False, error=error)
        timeout = msg.timeout_s or self._settings.recv_timeout_s
        queue = msg.queue_timeout_s or self._settings.recv_queue_timeout_s or timeout
        req = RecvRequest(
            id=msg.request,
            rank=msg.rank,
            prompt_len=msg.prompt_len,
            blocks=blocks(msg.block_ids),
            deadline=self._clock() + queue,
            peer=msg.prefill_engine,
            manifest=receive_manifest(agent.desc, msg.prefill_tp),
            traceparent=msg.traceparent,
            timeout_s=timeout,
            queue_timeout_s=queue,
            bell=agent.ring,
        )
        agent.recvs[req.id] = req
        try:
            check_block_ids(agent.desc, req.blocks, "decode")
        except OutOfBoundsError as e:
            req.finish(Status.FAILED, str(e))
            return Reply(ok=False, error=str(e))
        return Reply(data={"senders": len(req.manifest)})

    # ---- messages from prefill peers ---------------------------------------------------------

    def claim(self, msg: Claim) -> Ack:
        """A P rank will write this request: only into the request's own blocks."""
        err = self._check_claim(msg)
        if err:
            self.counters["refused_claims"] += 1
            return Ack(request=msg.request, ok=False, error=err)
        req = self._agents[msg.target_rank].recvs[msg.request]
        req.senders[msg.sender_rank] = msg.sender_engine
        now = self._clock()
        if req.claimed_at is None:
            # Prefill scheduled the request: from now on its progress keeps the receive, and
            # recv_timeout_s without any ends it, however long it queued (and no later than
            # that, however long the queue bound).
            req.claimed_at = now
            req.idle_s = req.timeout_s
            req.cap = now + self._settings.transfer_max_s
        req.progressed(now)
        return Ack(request=msg.request)

    def _stale(self, epoch: str) -> str:
        """Why a message for ``epoch`` is refused ("" when it is this sidecar's)."""
        if epoch == self._epoch():
            return ""
        return f"stale epoch {epoch}; this sidecar runs {self._epoch()}"

    def _check_claim(self, msg: Claim) -> str:
        if stale := self._stale(msg.epoch):
            return stale
        agent = self._agents.get(msg.target_rank)
        req = agent.recvs.get(msg.request) if agent else None
        if req is None or req.state.terminal:
            return f"request {msg.request} is not expected on rank {msg.target_rank}"
        if msg.sender_rank not in req.manifest:
            return f"prefill rank {msg.sender_rank} is not in the manifest"
        if req.peer and req.peer != msg.sender_engine:
            return f"request {msg.request} expects prefill {req.peer}, not {msg.sender_engine}"
        other = next((e for e in req.senders.values() if e != msg.sender_engine), None)
        if other is not None:
            return f"request {msg.request} is already claimed by prefill {other}"
        mine = [b.tolist() for b in req.blocks]
        if msg.block_ids != mine:
            # The router handed prefill another request's target, or a stale one.
            return (
                f"block ids {_short(msg.block_ids)} are not request {msg.request}'s "
                f"{_short(mine)} on rank {msg.target_rank}"
            )
        return ""

    async def done_checked(self, msg: Done) -> Ack:
        """``done``, with the bytes a Done's digests cover read on a worker thread: a long
        prompt's digest takes tens of milliseconds, which every other transfer's messages
        would wait for on the loop. The request is looked at again after it (``done``)."""
        agent = self._agents.get(msg.target_rank)
        req = agent.recent(msg.request, RecvRequest) if agent else None
        verdict = None
        live = agent is not None and req is not None and not req.state.terminal
        if msg.digests is not None and live:
            assert agent is not None and req is not None
            started = time.monotonic()
            verdict = await asyncio.to_thread(
                check_digests, agent, req, msg.sender_rank, msg.digests, self.digests
            )
            if verdict.checked:
                took = 1e3 * (time.monotonic() - started)
                req.digest_ms = round((req.digest_ms or 0.0) + took, 3)
        return self.done(msg, verdict)

    async def layer_digests(self, msg: LayerDigests) -> Ack:
        """Digests of layers that landed here, from the prefill rank that claimed the request,
        checked on a worker thread while later layers are computed: ``ok`` only when every run
        matched (prefill then leaves them out of ``Done``). A mismatch ends the request FAILED
        now, its sender asked to drain first (``end``)."""
        agent = self._agents.get(msg.target_rank)
        req = agent.recvs.get(msg.request) if agent else None
        if stale := self._stale(msg.epoch):
            why = stale
        elif agent is None or req is None or req.state.terminal:
            why = f"request {msg.request} is not expected on rank {msg.target_rank}"
        elif req.senders.get(msg.sender_rank) != msg.sender_engine:
            why = (
                f"prefill {msg.sender_engine} rank {msg.sender_rank} did not claim request "
                f"{msg.request}"
            )
        else:
            started = time.monotonic()
            verdict = await asyncio.to_thread(
                check_digests, agent, req, msg.sender_rank, msg.digests, self.digests
            )
            if verdict.checked:
                took = 1e3 * (time.monotonic() - started)
                req.digest_early_ms = round(req.digest_early_ms + took, 3)
            if verdict.why:
                self._digest_failed(req, verdict)
            if req.state.terminal:
                return Ack(request=msg.request, ok=False, error=req.error)
            if not verdict.checked:
                return Ack(request=msg.request, ok=False, error="decode holds no KV to digest")
            req.digest = "ok"
            req.digest_early_layers += int(np.unique(msg.digests.arrays()[0]).size)
            req.digest_early_checks += 1
            req.progressed(self._clock())
            return Ack(request=msg.request)
        return Ack(request=msg.request, ok=False, error=why)

    def _digest_failed(self, req: RecvRequest, verdict: DigestVerdict) -> None:
        """End ``req`` on its digest's check; counted and logged once, by the check that ended
        it (two layers checked at once may both differ)."""
        if req.state.terminal:
            return
        req.digest = "refused" if verdict.mismatch is None else "mismatch"
        req.digest_mismatch = verdict.mismatch
        self.end(req, Status.FAILED, verdict.why)
        log.warning("request %s: %s", req.id, verdict.why)
        if verdict.mismatch is not None:
            with self.digests.lock:
                self.digests.mismatches[(verdict.mismatch.kind, "decode")] += 1

    def done(self, msg: Done, verdict: DigestVerdict | None = None) -> Ack:
        """A sender's Done; ``verdict``: its digests' check, already made (``done_checked``)."""
        if stale := self._stale(msg.epoch):
            return Ack(request=msg.request, ok=False, error=stale)
        agent = self._agents.get(msg.target_rank)
        req = agent.recent(msg.request, RecvRequest) if agent else None
        if agent is None or req is None:
            return Ack(
                request=msg.request,
                ok=False,
                error=f"request {msg.request} is not expected on rank {msg.target_rank}",
            )
        claimed = req.senders.get(msg.sender_rank) == msg.sender_engine
        # A prefill that failed before it could claim (it refused the target) wrote nothing
        # and may say so, unless another prefill claimed the request. A Done for writes we
        # never agreed to is a forgery or a misrouting.
        unclaimed_failure = (
            msg.status is not Status.DONE
            and not req.senders
            and req.peer in ("", msg.sender_engine)
            and msg.sender_rank in req.manifest
        )
        if not claimed and not unclaimed_failure:
            return Ack(
                request=msg.request,
                ok=False,
                error=f"prefill {msg.sender_engine} rank {msg.sender_rank} did not claim "
                f"request {msg.request}",
            )
        if req.delivered.get(msg.sender_rank) is Status.DONE and msg.status is Status.DONE:
            # A retry after a lost ack: acknowledged again, counted once.
            self.counters["duplicate_dones"] += 1
            return Ack(request=msg.request)
        if req.state is Status.ABORTED:
            return Ack(request=msg.request, ok=False, error="aborted at decode")
        if req.state.terminal:
            return Ack(request=msg.request, ok=False, error=f"request already {req.state.name}")
        want = req.manifest[msg.sender_rank]
        req.bytes += msg.bytes
        if msg.status is not Status.DONE:
            # That sender drained before it said so; the others may still write.
            req.delivered[msg.sender_rank] = msg.status
            self.end(
                req,
                Status.FAILED,
                f"prefill rank {msg.sender_rank}: {msg.status.name} {msg.error or ''}".strip(),
            )
            return Ack(request=msg.request)
        if not want <= set(msg.groups):
            self.end(
                req,
                Status.FAILED,
                f"prefill rank {msg.sender_rank} delivered groups "
                f"{sorted(msg.groups)}, expected {sorted(want)}",
            )
            return Ack(request=msg.request)
        if msg.digests is not None:
            if verdict is None:
                verdict = check_digests(agent, req, msg.sender_rank, msg.digests, self.digests)
            if verdict.why:
                req.delivered[msg.sender_rank] = Status.FAILED  # it drained before its Done
                self._digest_failed(req, verdict)
                return Ack(request=msg.request)
            if verdict.checked:
                req.digest = "ok"
        req.delivered[msg.sender_rank] = Status.DONE
        req.state = Status.TRANSFERRING
        req.progressed(self._clock())  # one sender is through; the others may still write
        if set(req.delivered) >= set(req.manifest) and req.finish(Status.DONE):
            for g in {g for groups in req.manifest.values() for g in groups}:
                agent.groups[g].done += 1
        return Ack(request=msg.request)

    def still_sending(self, engine_id: str, rids: list[str]) -> None:
        """A heartbeat of prefill ``engine_id`` named ``rids`` as sends it still has in flight
        here: each receive it claimed waits its idle bound anew. One it did not claim is not
        its to keep."""
        now = self._clock()
        for agent in self._agents.values():
            for rid in rids:
                req = agent.recvs.get(rid)
                if req is not None and engine_id in req.senders.values():
                    req.progressed(now)

    def refused(self, rid: str, engine_id: str, reason: str) -> None:
        """This sidecar refused the handshake prefill ``engine_id`` made for ``rid``: nothing of
        it will come, so the load ends now, saying why, not at its deadline."""
        for agent in self._agents.values():
            req = agent.recvs.get(rid)
            if req is not None:
                self.end(req, Status.FAILED, f"refused prefill {engine_id}: {reason}")

    def aborted_by_prefill(self, rid: str, engine_id: str, reason: str) -> None:
        """The prefill that claimed ``rid`` ended it; it drained before it said so."""
        for agent in self._agents.values():
            req = agent.recvs.get(rid)
            if req is None or engine_id not in req.senders.values():
                continue
            for rank, sender in req.senders.items():
                if sender == engine_id:
                    req.delivered.setdefault(rank, Status.ABORTED)
            self.end(req, Status.ABORTED, f"prefill: {reason}")

    # ---- ending and quarantine -------------------------------------------------------------

    def end(self, req: RecvRequest, state: Status, reason: str) -> bool:
        """End ``req``; quarantine its blocks while a sender that claimed it may still write."""
        if not req.finish(state, reason):
            # Already ended: a sender that reports now may be the last one we waited for.
            self._maybe_release(req)
            return False
        writers = self._writers(req)
        if writers:
            req.quarantined_at = self._clock()
            self.counters["quarantined"] += 1
            for engine_id in writers:
                self._fence(engine_id)
        return True

    async def abort(self, rank: int, rid: str, reason: str) -> bool:
        """The engine or an operator ended a receive: senders are asked to drain first."""
        req = agent_of(self._agents, rank).recvs.get(rid)
        return req is not None and self.end(req, Status.ABORTED, reason)

    def _writers(self, req: RecvRequest) -> set[str]:
        """Engines that claimed the request and have not told us they stopped writing."""
        return {e for rank, e in req.senders.items() if rank not in req.delivered}

    def _held(self, engine_id: str) -> list[RecvRequest]:
        return [
            req
            for agent in self._agents.values()
            for req in agent.recvs.values()
            if req.quarantined_at is not None and engine_id in self._writers(req)
        ]

    def _fence(self, engine_id: str) -> None:
        wake = self._fences.get(engine_id)
        if wake is not None:
            wake.set()  # one more request for the running fence
            return
        self._fences[engine_id] = asyncio.Event()
        self._spawn(self._hold(engine_id))

    async def _hold(self, engine_id: str) -> None:
        """Keep the requests ``engine_id`` claimed in quarantine until, per request, it answers
        the ``Abort`` (it answers once nothing of that request is on the wire); all at once
        when its sidecar is gone (connection refused); each after ``quarantine_max_s``.

        Being silent past the lease is not enough: a stopped (SIGSTOP) prefill's transfer
        engine finishes the write it had started when it wakes up (measured: 783,291 bytes
        landed in blocks the lease had already released).
        """
        s = self._settings
        wake = self._fences[engine_id]
        endpoint = self._peers.endpoint_of(engine_id)
        client = self._peers.connect(endpoint) if endpoint else None
        asks: dict[str, asyncio.Task[AnyMsg]] = {}
        try:
            while held := self._held(engine_id):
                if client is None or endpoint is None:
                    self._stopped(held, engine_id, "it never said where it listens")
                    break
                for req in held:
                    if req.id not in asks:
                        abort = Abort(request=req.id, reason=req.error, sender_engine=s.engine_id)
                        asks[req.id] = asyncio.create_task(
                            client.request(abort, s.quarantine_max_s)
                        )
                now = self._clock()
                answered = [r for r in held if _acked(asks[r.id])]
                self._stopped(answered, engine_id, "")
                overdue = [
                    r
                    for r in held
                    if r not in answered and now - (r.quarantined_at or now) > s.quarantine_max_s
                ]
                self._stopped(
                    overdue,
                    engine_id,
                    f"no answer within quarantine_max_s ({s.quarantine_max_s:g} s); a write it "
                    "still had on the wire may land in the released blocks",
                )
                for req in answered + overdue:
                    asks.pop(req.id, None)
                wake.clear()
                pending = [t for t in asks.values() if not t.done()]
                woken = asyncio.ensure_future(wake.wait())
                done, _ = await asyncio.wait(
                    [*pending, woken], timeout=s.heartbeat_interval_s, return_when=FIRST_COMPLETED
                )
                woken.cancel()
                if not done and await client.gone():
                    self._stopped(self._held(engine_id), engine_id, "its sidecar is gone")
        finally:
            for task in asks.values():
                task.cancel()
            if client is not None:
                await client.close()
            del self._fences[engine_id]

    def _stopped(self, reqs: list[RecvRequest], engine_id: str, why: str) -> None:
        """``engine_id`` writes nothing more to ``reqs``: release them unless another sender
        may still write."""
        for req in reqs:
            if why:
                log.warning("request %s: prefill %s released: %s", req.id, engine_id, why)
            for rank, e in req.senders.items():
                if e == engine_id:
                    req.delivered.setdefault(rank, Status.ABORTED)
            self._maybe_release(req)

    def _maybe_release(self, req: RecvRequest) -> None:
        if req.quarantined_at is not None and not self._writers(req):
            log.info(
                "request %s: out of quarantine after %.3f s",
                req.id,
                self._clock() - req.quarantined_at,
            )
            req.quarantined_at = None
            req.ring()

    def expire(self, now: float) -> int:
        """End EXPIRED every receive past its deadline at ``now``; how many it ended."""
        ended = 0
        for agent in list(self._agents.values()):
            for req in list(agent.recvs.values()):
                if not req.state.terminal and now > req.deadline:
                    ended += self.end(req, Status.EXPIRED, expiry_reason(req))
        return ended

    def peer_lost(self, peer: Peer, reason: str, *, stopped: bool = False) -> None:
        """A prefill peer is gone: its requests end. Unless it ``stopped`` writing (it said
        so), their blocks stay quarantined until it confirms or is known to be gone."""
        for agent in self._agents.values():
            for req in list(agent.recvs.values()):
                ranks = [r for r, e in req.senders.items() if e == peer.engine_id]
                if not ranks:
                    continue
                if stopped:
                    for rank in ranks:
                        req.delivered.setdefault(rank, Status.FAILED)
                self.end(req, Status.FAILED, reason)

    def live_peers(self) -> set[str]:
        out = set()
        for agent in self._agents.values():
            for req in agent.recvs.values():
                if not req.state.terminal or req.quarantined_at is not None:
                    for e in req.senders.values():
                        peer = self._peers.by_engine(e)
                        if peer is not None:
                            out.add(peer.endpoint)
        return out


def _acked(task: asyncio.Task[AnyMsg]) -> bool:
    return (
        task.done()
        and not task.cancelled()
        and task.exception() is None
        and isinstance(task.result(), Ack)
    )


def _short(ids: list[list[int]]) -> str:
    text = str(ids)
    return text if len(text) <= 80 else text[:77] + "..."


def expiry_reason(req: RecvRequest) -> str:
    """Why ``req`` ended EXPIRED, in the terms of the setting that bounded it."""
    if req.claimed_at is None:
        return (
            f"no prefill claimed it within {req.queue_timeout_s:g} s (recv_queue_timeout_s): "
            "its prefill never scheduled it, or never got decode's target"
        )
    senders = ", ".join(sorted(set(req.senders.values())))
    if req.at_cap():
        since = req.cap - (req.claimed_at or req.cap)
        return (
            f"prefill {senders} claimed it but did not finish within {since:g} s of the claim "
            "(transfer_max_s), however it progressed"
        )
    return (
        f"prefill {senders} claimed it but nothing said it still sends it for {req.idle_s:g} s "
        "(recv_timeout_s): no claim, no Done, no heartbeat naming it"
    )
