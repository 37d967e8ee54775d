"""How a send ends: ``Done`` to every decode rank it wrote to, an ``Abort`` from either side, a
lost peer or a new decode epoch, and the waits for writes still on the wire that each needs first.

``SendSide`` (``sending``) admits sends and writes their layers; this base of it ends them.
Decode frees a request's blocks once told it ended, so whatever ends a send, decode hears of it
only once none of its writes is on the wire.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from app.errors import DeadlineExceeded, KVSidecarError
from app.kvcache.digest import DigestRuns, DigestShare
from app.transfer.control.peers import Peer, Peers
from app.transfer.requests.agent import Agent, SendRequest, agent_of
from app.transfer.requests.integrity import (
    DigestStats,
    LayerDigest,
    digest_runs,
    layer_digest,
    sender_digests,
)
from app.transfer.wire.protocol import (
    MAX_DEADLINE_S,
    Abort,
    Ack,
    Done,
    Error,
    LayerDigests,
    Msg,
    Status,
)

log = logging.getLogger(__name__)

# Messages a digested request's layers go in before ``Done`` (``LayerDigests``), at most: few
# enough that a short prompt's small layers do not pay a round trip each, several so that each
# is checked while later layers are computed.
_EARLY_MESSAGES = 4

Spawn = Callable[[Coroutine[Any, Any, None]], None]


@dataclass(frozen=True)
class SendSettings:
    """What the send side reads of the sidecar's settings."""

    engine_id: str
    # No progress for this long (no chunk scheduled, no layer signalled or written) ends a send
    # EXPIRED; so does ``transfer_max_s`` from its admission, however it progresses.
    send_timeout_s: float
    ack_timeout_s: float
    max_target_timeout_s: float = 120.0
    transfer_max_s: float = MAX_DEADLINE_S
    max_held_sends: int = 256
    max_held_blocks: int | None = None
    # Of requests whose KV is digested (issue 51; 1.0: every one), as the admin API sets it.
    digest: DigestShare = field(default_factory=lambda: DigestShare(0.0))


class SendEnding:
    """The ending of prefill's sends, on every local rank (the base of ``SendSide``)."""

    def __init__(
        self, settings: SendSettings, agents: dict[int, Agent], peers: Peers, *, spawn: Spawn
    ) -> None:
        self._settings, self._agents, self._peers = settings, agents, peers
        self._spawn = spawn
        self.digests = DigestStats()
        self.unconfirmed = 0  # sends whose writes outlived their deadline (each told late)
        # Set (and replaced) each time writes leave the wire; drains wait on it.
        self._unpinned: asyncio.Event | None = None

    def _agent(self, rank: int) -> Agent:
        return agent_of(self._agents, rank)

    def _wake_drains(self) -> None:
        # A fresh event per wake-up: a waiter that looked at the count before this runs holds
        # the old one and is woken; one that looks after sees the new count.
        wake, self._unpinned = self._unpinned, None
        if wake is not None:
            wake.set()

    def fail(self, req: SendRequest, error: str, state: Status = Status.FAILED) -> bool:
        """End ``req`` here and tell decode once its writes drained."""
        if not req.finish(state, error):
            return False
        self._spawn(self.send_done(req))
        return True

    async def drained(self, req: SendRequest) -> bool:
        """Wait until none of ``req``'s writes is on the wire; False at the send deadline."""
        try:
            async with asyncio.timeout(self._settings.send_timeout_s):
                await self._until_unpinned(req)
        except TimeoutError:
            return False
        return True

    async def _until_unpinned(self, req: SendRequest) -> None:
        while req.inflight > 0:
            if self._unpinned is None:
                self._unpinned = asyncio.Event()
            await self._unpinned.wait()

    async def confirmed(self, req: SendRequest) -> None:
        """Wait until Mooncake confirmed (or failed) every write of ``req`` on the wire.

        Decode frees its blocks once told Done, Abort or Ack, so none goes out while a write
        may still land: past the send deadline this keeps waiting, bounded by Mooncake's own
        write timeout (a stalled write fails after its "no transfer progress" timeout, 30 s
        measured), and the engine gets the blocks back only then too (``Agent.finished``)."""
        if await self.drained(req):
            return
        log.error(
            "request %s: %d write(s) still on the wire after send_timeout_s (%g s); decode is "
            "told nothing until Mooncake confirms or fails them",
            req.id,
            req.inflight,
            self._settings.send_timeout_s,
        )
        self.unconfirmed += 1
        await self._until_unpinned(req)

    def final_layer_written(self, req: SendRequest, layer: int) -> None:
        """``layer`` of ``req``'s final step is written. When ``req`` is drawn for the digest,
        digest the final step's layer written before it now, on a worker thread while the engine
        computes the next ones, and send it to decode, which checks it as it is (that layer has
        landed: the stream writes in order, each write confirmed before the next). One layer
        behind, not at once: an engine whose layer signal came before its writes ended (a late
        write) has had a layer's compute to finish them, which the digest then sees. Layers go
        in a few messages (``_EARLY_MESSAGES``), not one each: each costs both sidecars a thread
        hop, a frame and an ack. The layer before the last goes in ``Done`` with the last:
        nothing is computed after it."""
        before, req.last_final_layer = req.last_final_layer, layer
        agent = self._agents.get(req.rank)
        peer = self._peers.table.get(req.peer)
        if (
            before is None
            or min(before, layer) < 0  # every layer at once (bulk): digested at Done
            or agent is None
            or agent.digest_memory is None
            or peer is None
            or not self._settings.digest.draw(req.id)
        ):
            return
        job = asyncio.to_thread(
            layer_digest, agent, peer.planners[req.rank], req, before, self.digests
        )
        made = asyncio.ensure_future(job)
        made.add_done_callback(_retrieved)
        req.early_open[before] = made
        send = req.final_layers_left > 1 and peer.layer_digests
        # Layers a message: all but the last two, in _EARLY_MESSAGES messages.
        size = -(-(len(agent.desc.placements) - 2) // _EARLY_MESSAGES)
        if send and req.final_layers_left > 2 and len(req.early_open) < size:
            return  # the batch fills on; the one before the last layer closes it
        batch, req.early_open = req.early_open, {}
        if send:
            task = asyncio.ensure_future(self._early_check(peer, req, batch))
            task.add_done_callback(_retrieved)
            for member in batch:
                req.early_digests[member] = task
        else:  # Done carries them
            for member, fut in batch.items():
                req.early_digests[member] = fut

    async def _early_check(
        self, peer: Peer, req: SendRequest, batch: dict[int, asyncio.Future[LayerDigest]]
    ) -> dict[int, LayerDigest]:
        """The layers of ``batch`` once digested, checked by decode now. What ``Done`` must
        still carry of each: the runs of the decode ranks that did not confirm theirs (a layer
        whose digest failed is left out: ``Done`` digests it again)."""
        made = {}
        for layer, fut in batch.items():
            with contextlib.suppress(Exception):
                made[layer] = await fut
        if req.state.terminal or not made:
            return made
        ranks = digest_runs([part for parts in made.values() for part in parts])
        confirmed = await asyncio.gather(
            *(self._layer_checked(peer, req, d, runs) for d, runs in ranks.items())
        )
        checked = {d for d, ok in zip(ranks, confirmed, strict=True) if ok}
        if checked == set(ranks):
            req.digest_early_layers += len(made)
        return {layer: [p for p in parts if p[0] not in checked] for layer, parts in made.items()}

    async def _layer_checked(
        self, peer: Peer, req: SendRequest, d_rank: int, runs: DigestRuns
    ) -> bool:
        """Whether decode rank ``d_rank`` checked ``runs`` and found them equal. A decode that
        does not know ``LayerDigests`` (an older release) gets every digest in ``Done`` from
        then on."""
        msg = LayerDigests(
            request=req.id,
            sender_engine=self._settings.engine_id,
            sender_rank=req.rank,
            target_rank=d_rank,
            epoch=peer.epoch,
            digests=runs,
        )
        try:
            reply = await peer.client.request(msg, self._settings.ack_timeout_s)
        except KVSidecarError as e:  # a deadline, a closed link: Done carries it instead
            log.info("send %s: layer digests not checked early: %s", req.id, e)
            return False
        if isinstance(reply, Error) and peer.layer_digests:
            peer.layer_digests = False
            log.warning(
                "decode %s refused LayerDigests (%s): an older release? Its digests go in "
                "Done from now on",
                peer.endpoint,
                reply.reason,
            )
        return isinstance(reply, Ack) and reply.ok

    async def send_done(self, req: SendRequest) -> None:
        """Tell every D rank this rank wrote to how the request ended, and wait for the acks."""
        status = Status.DONE if not req.state.terminal else req.state
        peer = self._peers.table.get(req.peer)
        if req.peer_lost or peer is None:
            req.finish(Status.FAILED, req.error or "no decode peer")
            return
        if not req.d_ranks:
            # This rank holds nothing any D rank needs (e.g. MLA comes from another P rank).
            req.finish(status, req.error)
            return
        await self.confirmed(req)
        if req.peer_lost:
            return  # ended during the drain by an abort, whose Abort replaces this Done
        status = Status.DONE if not req.state.terminal else req.state
        errors = []
        digests = {}
        if status is Status.DONE and self._settings.digest.draw(req.id):
            planner = peer.planners[req.rank]
            started = time.monotonic()
            try:
                early = await _made(req)
                digests = await asyncio.to_thread(
                    sender_digests, self._agents[req.rank], planner, req, self.digests, early
                )
            except (KVSidecarError, ValueError) as e:  # unchecked, not failed: the KV is sent
                log.warning("send %s: no KV digest: %s", req.id, e)
            if digests or req.digest_early_layers:
                req.digest = "sent"
                req.digest_ms = round(1e3 * (time.monotonic() - started), 3)
        for d_rank, groups in req.d_ranks.items():
            done = Done(
                request=req.id,
                sender_engine=self._settings.engine_id,
                sender_rank=req.rank,
                target_rank=d_rank,
                epoch=peer.epoch,
                status=status,
                groups=sorted(groups),
                bytes=req.d_bytes.get(d_rank, 0),  # what this D rank received
                error=req.error or None,
                digests=digests.get(d_rank),
            )
            try:
                ack = await self._request_with_retries(peer, done)
            except (DeadlineExceeded, KVSidecarError) as e:
                errors.append(str(e))
                continue
            if not isinstance(ack, Ack) or not ack.ok:
                errors.append(f"decode rank {d_rank} refused Done: {why_refused(ack)}")
        if not errors and status is Status.DONE:
            for g in {g for groups in req.d_ranks.values() for g in groups}:
                self._agents[req.rank].groups[g].done += 1
        if errors:
            peer.failures += 1
            req.finish(
                Status.ABORTED if any("aborted" in e for e in errors) else Status.FAILED,
                "; ".join(errors),
            )
        else:
            req.finish(Status.DONE)

    async def _request_with_retries(self, peer: Peer, msg: Done, attempts: int = 3) -> Msg:
        """A lost frame must not turn a good transfer into an expiry: D acknowledges a repeated
        Done again without counting it twice."""
        for _ in range(attempts - 1):
            try:
                return await peer.client.request(msg, self._settings.ack_timeout_s)
            except DeadlineExceeded:
                log.warning("no ack for Done of %s from %s; retrying", msg.request, peer.endpoint)
        return await peer.client.request(msg, self._settings.ack_timeout_s)

    async def abort(self, rank: int, rid: str, reason: str, *, notify: bool) -> bool:
        """End a send here (the engine or an operator asked); tell decode if ``notify``."""
        req = self._agent(rank).sends.get(rid)
        if req is None or not req.finish(Status.ABORTED, reason):
            return False
        req.peer_lost = True  # the Abort below replaces the Done
        peer = self._peers.table.get(req.peer)
        if notify and peer is not None:
            await self.confirmed(req)
            try:
                await peer.client.request(
                    Abort(request=rid, reason=reason, sender_engine=self._settings.engine_id),
                    self._settings.ack_timeout_s,
                )
            except KVSidecarError:
                peer.failures += 1
                raise
        return True

    async def aborted_by_decode(self, rid: str, engine_id: str, reason: str) -> None:
        """Decode ended the request: stop writing, answer once nothing is on the wire."""
        # Also one already reported to our engine whose write to a lost peer is still on the
        # wire: decode holds the blocks until we answer.
        found = (a.recent(rid, SendRequest) for a in self._agents.values())
        reqs = [r for r in found if r is not None]
        for req in reqs:
            peer = self._peers.table.get(req.peer)
            if peer is not None and peer.engine_id != engine_id:
                continue  # only the decode the request targets may end it
            if req.finish(Status.ABORTED, f"decode: {reason}"):
                req.peer_lost = True
        for req in reqs:
            await self.confirmed(req)

    async def peer_lost(self, peer: Peer, reason: str, *, epoch: str | None = None) -> None:
        """``peer`` is gone (or its memory is, for requests targeting ``epoch``): end its
        requests without writing more, and wait for what is on the wire."""
        ended = []
        for agent in self._agents.values():
            for req in list(agent.sends.values()):
                if req.peer != peer.endpoint or (epoch is not None and req.target_epoch != epoch):
                    continue
                if req.finish(Status.FAILED, reason):
                    req.peer_lost = True
                    ended.append(req)
        for req in ended:
            if not await self.drained(req):
                # Reported to the engine only once answered (Agent.finished); nothing to tell.
                log.warning("request %s: %d write(s) still on the wire", req.id, req.inflight)

    def live_peers(self) -> set[str]:
        return {r.peer for a in self._agents.values() for r in a.sends.values() if r.peer}

    def expire(self, now: float) -> int:
        """End EXPIRED every send past its deadline at ``now``; how many it ended."""
        ended = 0
        for agent in list(self._agents.values()):
            for req in list(agent.sends.values()):
                if not req.state.terminal and now > req.deadline:
                    ended += self.fail(req, self.expiry_reason(req), Status.EXPIRED)
        return ended

    def expiry_reason(self, req: SendRequest) -> str:
        """Why ``req`` ended EXPIRED, in the terms of the setting that bounded it."""
        s = self._settings
        if req.at_cap():
            return (
                f"still sending {s.transfer_max_s:g} s after admission (transfer_max_s), "
                "however it progressed"
            )
        if req.held:
            return "decode's target did not come in time (target_timeout_s, max_target_timeout_s)"
        return (
            f"no progress for {req.idle_s or s.send_timeout_s:g} s (send_timeout_s): no chunk "
            "scheduled, no layer signalled or written"
        )


def why_refused(reply: Msg) -> str:
    """What a refusal (a nack or an ``Error``/``Rejected`` reply) said."""
    return (reply.error or "") if isinstance(reply, Ack) else getattr(reply, "reason", "")


def _retrieved(task: asyncio.Future[Any]) -> None:
    # A request that failed never awaits its early digests: their errors are not news.
    if not task.cancelled():
        task.exception()


async def _made(req: SendRequest) -> dict[int, LayerDigest]:
    """The layers of ``req`` digested early, less what decode confirmed; one whose digest
    failed is left out (made again at ``Done``)."""
    out: dict[int, LayerDigest] = {}
    for layer, task in {**req.early_digests, **req.early_open}.items():
        try:
            got = await task
        except Exception as e:  # made again at Done, where an error is handled as always
            log.info("send %s: early digest of layer %d failed (%s); made again", req.id, layer, e)
            continue
        if isinstance(got, dict):  # a batch decode was asked to check
            if layer in got:
                out[layer] = got[layer]
        else:
            out[layer] = got
    return out
