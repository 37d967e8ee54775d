"""The prefill side's request state machine: admit, claim, write layer by layer, report.

A send is admitted with decode's block ids, *claimed* at decode before its first write (decode
checks the blocks are the request's own and learns whom to ask to drain), written as the
engine signals layers, and ends DONE when every decode rank it wrote to acknowledged its
``Done``. Whatever ends it otherwise (a write error, a nack, an abort from either side, the
deadline, a lost lease, a new decode epoch), ``Done`` and the answer to decode's ``Abort`` wait
until none of its writes is on the wire. Admission and writes are here; the ending (``Done``,
aborts, lost peers, the drains they wait for) is ``send_ending``'s, the base of ``SendSide``.

Its deadline follows progress: a chunk scheduled, a layer signalled or written pushes it to
``send_timeout_s`` from then, up to ``transfer_max_s`` from admission. This sidecar's
heartbeats name to each decode peer the sends it still has in flight there (``sending_to``),
so decode's receive waits as long as prefill's send lives.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence

import zmq

from app.devices import CpuEvent, Event
from app.devices.events import Gate, RefusedEvent, RingWait
from app.errors import AuthError, KVSidecarError, OutOfBoundsError
from app.transfer.control.peers import Peer, Peers
from app.transfer.planning.planner import StepRequest, check_block_ids
from app.transfer.requests.agent import Agent, GroupProgress, Held, SendRequest, StepState, blocks
from app.transfer.requests.send_ending import SendEnding, SendSettings, Spawn, why_refused
from app.transfer.requests.stream import ALL_LAYERS, Batch, LayerResult, LayerTask
from app.transfer.wire.protocol import (
    MAX_SENDING,
    Ack,
    AddSend,
    BeginStep,
    Claim,
    LayerReady,
    Msg,
    RemoteTarget,
    Reply,
    SetTarget,
    Status,
    tcp_endpoint,
)
from app.transfer.wire.target_auth import check_bound, check_target

log = logging.getLogger(__name__)

# An event wait gives up this long (at most a tenth of the send deadline) before the earliest
# deadline of the requests it holds up, so that they end FAILED with a sentence naming the
# event instead of EXPIRED by the deadline watcher, which polls every 50 ms.
_EVENT_MARGIN_S = 0.5


class SendSide(SendEnding):
    """Prefill requests of every local rank: admission, targets and claims, layer writes; how
    they end is ``SendEnding``'s."""

    def __init__(
        self,
        settings: SendSettings,
        agents: dict[int, Agent],
        peers: Peers,
        *,
        spawn: Spawn,
        call_soon: Callable[..., None],
        on_layer_latency: Callable[[float], None],
        verify_target: Callable[[RemoteTarget], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``call_soon(fn, *args)`` runs ``fn`` on the loop and may be called from any thread
        (the stream threads pin, unpin and report through it). ``verify_target`` raises
        AuthError for a target decode's sidecar did not sign; none such is ever connected to."""
        super().__init__(settings, agents, peers, spawn=spawn)
        self._call_soon, self._clock = call_soon, clock
        self._verify_target = verify_target
        self._on_layer_latency = on_layer_latency
        self.admitting = True
        # Targets refused before anything was connected to: unsigned, forged, of an older
        # format, or signed for another transfer or another prompt (a captured target replayed).
        self.counters = {"refused_targets": 0}

    # ---- admission -------------------------------------------------------------------------

    def _new(self, msg: AddSend, report: bool) -> SendRequest | Reply:
        """The send's record, or why none was made (reported to the engine if ``report``)."""
        agent = self._agent(msg.rank)
        error = agent.refusal(
            msg.request,
            msg.block_ids,
            admitting=self.admitting,
            held=agent.sends,
            known="already in flight",
            report=report,
            over=self._over_hold_limit(agent, msg),
        )
        if error:
            return Reply(ok=False, error=error)
        now, s = self._clock(), self._settings
        req = SendRequest(
            id=msg.request,
            rank=msg.rank,
            prompt_len=msg.prompt_len,
            blocks=blocks(msg.block_ids),
            deadline=now + min(s.send_timeout_s, s.transfer_max_s),
            cap=now + s.transfer_max_s,
            peer="",
            mamba_mode=msg.mamba_mode,
            num_spec=msg.num_spec,
            traceparent=msg.traceparent,
            prompt_digest=msg.prompt_digest,
            bell=agent.ring,
        )
        agent.sends[req.id] = req
        try:
            check_block_ids(agent.desc, req.blocks, "prefill")
            if msg.remote is not None:
                self._authorize(req, msg.remote)
        except KVSidecarError as e:
            return self._refuse(req, str(e))
        if msg.remote is None:
            # The target comes with SetTarget. Until then prefill's progress does not extend the
            # wait: the send waits on decode, not on its own engine.
            req.waiting = True
            if msg.target_timeout_s is not None:
                wait = min(msg.target_timeout_s, s.max_target_timeout_s)
                req.deadline = min(now + wait, req.cap)
        else:
            req.idle_s = s.send_timeout_s
        return req

    def _over_hold_limit(self, agent: Agent, msg: AddSend) -> str:
        """Why a send admitted without a target would hold too much ("" if it would not): a
        held send pins prefill's blocks until decode answers, so strangers' prompts or a slow
        decode must not pin the whole cache."""
        if msg.remote is not None:
            return ""
        s = self._settings
        held = agent.held_sends()
        if len(held) >= s.max_held_sends:
            return (
                f"rank {agent.rank} already holds {len(held)} sends waiting for decode's target "
                f"(max_held_sends={s.max_held_sends}); decode recomputes this one"
            )
        if s.max_held_blocks is not None:
            pinned = sum(r.block_count for r in held) + sum(len(ids) for ids in msg.block_ids)
            if pinned > s.max_held_blocks:
                return (
                    f"rank {agent.rank}: holding this send would pin {pinned} blocks waiting "
                    f"for decode's target (max_held_blocks={s.max_held_blocks}); decode "
                    "recomputes it"
                )
        return ""

    def admit(self, msg: AddSend) -> None:
        """Admit a send without waiting for anything (a step's one-way ``BeginStep``). A
        target it came with is claimed in the background; layers signalled meanwhile are
        held, then written in order. A refusal reaches the engine in ``get_finished``."""
        got = self._new(msg, report=True)
        if isinstance(got, SendRequest) and msg.remote is not None:
            got.waiting = True
            self._spawn(self._claim_and_replay(self._agent(msg.rank), got, msg.remote))

    async def add(self, msg: AddSend) -> Msg:
        """Admit a send and, with a target, answer once decode took the claim (or refused)."""
        got = self._new(msg, report=False)
        if isinstance(got, Reply) or msg.remote is None:
            return got if isinstance(got, Reply) else Reply()
        return await self._target(self._agent(msg.rank), got, msg.remote)

    def set_target(self, msg: SetTarget) -> Reply:
        """Decode's target for a send admitted without one. Answers at once; the claim at
        decode and the backlog's writes follow, and a refusal there ends the send FAILED (the
        engine hears of it in ``get_finished``), so the engine link never waits on decode."""
        agent = self._agent(msg.rank)
        req = agent.sends.get(msg.request)
        if req is None:
            return Reply(ok=False, error=f"no send {msg.request} in flight on rank {msg.rank}")
        if req.state.terminal:
            return Reply(ok=False, error=f"send {msg.request} already ended {req.state.name}")
        if not req.waiting or req.peer:
            return Reply(ok=False, error=f"send {msg.request} already has a target ({req.peer})")
        try:
            # From the engine (which fetched it from the router): no other target will come.
            self._authorize(req, msg.remote)
        except KVSidecarError as e:
            return self._refuse(req, str(e))
        # The target is the send's from here on, before anything awaits: of two posts racing,
        # the second finds it taken.
        req.peer = tcp_endpoint(msg.remote.host, msg.remote.port)
        # The wait for a target had a deadline of its own; from here on progress extends it.
        req.idle_s = self._settings.send_timeout_s
        req.deadline = max(req.deadline, min(self._clock() + req.idle_s, req.cap))
        self._spawn(self._claim_and_replay(agent, req, msg.remote))
        return Reply()

    def _authorize(self, req: SendRequest, target: RemoteTarget) -> None:
        """Raise AuthError (counted) unless decode's sidecar signed ``target`` for ``req``'s
        transfer and for the prompt ``req``'s engine runs.

        The transfer: another transfer's target, however well signed, would end this send at
        decode's claim, and its own target would then find it ended. The prompt: a target seen
        once and posted again, with another prompt under the same transfer id, would have that
        prompt's KV written into decode's blocks of the first."""
        try:
            self._verify_target(target)
            check_bound(target, req.id, req.prompt_digest)
        except AuthError:
            self.counters["refused_targets"] += 1
            raise

    def sending_to(self, endpoint: str) -> list[str]:
        """The sends claimed at ``endpoint`` still in flight here, for the next heartbeat to it:
        each made progress within ``send_timeout_s`` (else it would have ended), so decode's
        receive of it waits on (``RecvSide.still_sending``)."""
        live = [
            r.id
            for a in self._agents.values()
            for r in a.sends.values()
            if r.peer == endpoint and r.d_ranks and not r.state.terminal
        ]
        return live[:MAX_SENDING]

    def check_target(self, rank: int, rid: str, target: RemoteTarget) -> None:
        """Raise ProtocolError unless ``target`` fits send ``rid`` on ``rank`` (one block id
        list per group, none longer than the prompt could need), AuthError (counted) unless it
        was signed for its transfer and prompt; a send not held passes."""
        req = self._agent(rank).sends.get(rid)
        if req is not None:
            self._authorize(req, target)
            check_target(target, len(req.blocks), req.prompt_len + req.num_spec + 1)

    async def _claim_and_replay(self, agent: Agent, req: SendRequest, t: RemoteTarget) -> None:
        reply = await self._target(agent, req, t)
        if isinstance(reply, Reply) and reply.ok:
            await self._replay(agent, req)
        else:
            log.warning("send %s: target refused: %s", req.id, getattr(reply, "error", reply))

    async def _target(self, agent: Agent, req: SendRequest, t: RemoteTarget) -> Msg:
        """Point ``req`` at decode's blocks and claim them there."""
        req.peer = tcp_endpoint(t.host, t.port)
        req.d_blocks = blocks(t.block_ids)
        req.target_epoch = t.epoch
        req.skip = t.computed
        try:
            peer = await self._peers.target(t.host, t.port, t.epoch, t.engine_id, req.id)
            planner = peer.planners[req.rank]
            # Known before the id check, so that D hears of a refusal instead of expiring.
            groups = {
                d: frozenset(
                    pl.group
                    for pl in agent.desc.placements
                    if planner.template(pl.layer, d)[0].size
                )
                for d in planner.peers()
            }
            req.d_ranks = {d: g for d, g in groups.items() if g}
            check_block_ids(next(iter(peer.descs.values())), req.d_blocks, "decode")
            await self._claim(peer, req, t.block_ids)
        except (KVSidecarError, ValueError, zmq.ZMQError, OSError) as e:
            # A transport error too: the send must end, or it would hold its blocks unclaimed.
            return self._refuse(req, f"target {req.peer}: {e or type(e).__name__}")
        return Reply()

    def _refuse(self, req: SendRequest, error: str) -> Reply:
        req.finish(Status.FAILED, error)
        self._spawn(self.send_done(req))
        return Reply(ok=False, error=error)

    async def _replay(self, agent: Agent, req: SendRequest) -> None:
        """Write the layers signalled before the target came, in the order they were, then
        let later signals write as they come. Each waits on the gate its first task opens:
        queued behind that task on the same thread, it never writes an incomplete layer."""
        peer = self._peers.table.get(req.peer)
        if req.state.terminal:
            peer = None  # ended while its claim was out: nothing to write
        else:
            req.state = Status.TRANSFERRING
        # Layers signalled while a replay waits on a full queue join the backlog: drain it
        # until it stays empty, then let signals write directly.
        while req.backlog and peer is not None and not req.state.terminal:
            held, req.backlog = req.backlog, []
            for h in held:
                step = self._step_request(req, h.start, h.end)
                if step is not None:
                    batch = Batch(req.peer, peer.te_session, peer.planners[req.rank], [step])
                    await self._queue(agent, LayerTask(h.step, h.layer, h.gate, [batch]))
        req.backlog = []
        req.waiting = False

    async def _claim(self, peer: Peer, req: SendRequest, d_ids: list[list[int]]) -> None:
        """Decode must know the writer before the first byte lands (DESIGN §4)."""
        for d_rank in req.d_ranks:
            claim = Claim(
                request=req.id,
                sender_engine=self._settings.engine_id,
                sender_rank=req.rank,
                target_rank=d_rank,
                epoch=peer.epoch,
                block_ids=d_ids,
            )
            ack = await peer.client.request(claim, self._settings.ack_timeout_s)
            if not isinstance(ack, Ack) or not ack.ok:
                raise KVSidecarError(
                    f"decode rank {d_rank} refused the request: {why_refused(ack)}"
                )
            self._peers.answered(peer)

    def begin_step(self, msg: BeginStep) -> None:
        """A step's slices (after its admissions): prefill blocks that grew, the step's record."""
        agent = self._agent(msg.rank)
        if not msg.slices:
            return
        record = agent.step_log.begin(msg.step)
        for s in msg.slices:
            req = agent.sends.get(s.request)
            if req is None or req.state.terminal:
                continue
            req.timeline.steps[msg.step] = record
            req.progressed(self._clock())  # a chunk of it is scheduled
            if s.block_ids is None:
                continue
            ids = blocks(s.block_ids)
            try:
                check_block_ids(agent.desc, ids, "prefill")
            except OutOfBoundsError as e:
                self.fail(req, str(e))
                continue
            req.blocks = ids
        agent.steps[msg.step] = StepState([(s.request, s.start, s.end) for s in msg.slices])

    # ---- layers ----------------------------------------------------------------------------

    async def layer_ready(self, msg: LayerReady) -> None:
        agent = self._agent(msg.rank)
        now = time.monotonic()  # the stream thread's clock: the timeline's times compare
        agent.step_log.signalled(msg.step, msg.at_step_end)
        step = agent.steps.get(msg.step)
        slices = step.slices if step else []
        by_peer: dict[str, list[StepRequest]] = {}
        held: list[tuple[SendRequest, int, int]] = []
        for rid, start, end in slices:
            req = agent.sends.get(rid)
            if req is None or req.state.terminal:
                continue
            req.timeline.signalled(msg.step, msg.layer, msg.at_step_end, now)
            req.progressed(self._clock())
            if end >= req.prompt_len and req.final_layers_left < 0:
                req.final_layers_left = len(agent.desc.placements)
                req.final_step = msg.step
            if req.waiting:
                held.append((req, start, end))
                continue
            req.state = Status.TRANSFERRING
            step_req = self._step_request(req, start, end)
            if step_req is not None:
                by_peer.setdefault(req.peer, []).append(step_req)
        batches = []
        for endpoint, steps in by_peer.items():
            peer = self._peers.table.get(endpoint)
            if peer is None:  # lost since admission; its requests already ended
                continue
            batches.append(Batch(endpoint, peer.te_session, peer.planners[msg.rank], steps))
        event, release = self._event(agent, msg, by_peer)
        gate: Gate | None = None
        if held:
            gate = Gate()
            for req, start, end in held:
                req.backlog.append(Held(msg.step, msg.layer, start, end, gate))
        task = LayerTask(msg.step, msg.layer, event, batches, release=release, gate=gate)
        await self._queue(agent, task)
        if step is not None:
            step.seen.add(msg.layer)
            # Engines signal layers in their own order (state layers only after the forward
            # pass), so the step ends when every layer was signalled, not at the last index.
            if ALL_LAYERS in step.seen or len(step.seen) >= len(agent.desc.placements):
                agent.steps.pop(msg.step, None)

    def _step_request(self, req: SendRequest, start: int, end: int) -> StepRequest | None:
        """``req``'s slice ``[start, end)`` to plan, without the tokens decode already holds;
        None when nothing of it is left (the slice carrying the prompt's end always is)."""
        if end < req.prompt_len and end <= req.skip:
            return None
        return StepRequest(
            req.id,
            req.prompt_len,
            max(start, req.skip),
            min(end, req.prompt_len),
            req.blocks,
            req.d_blocks,
            req.mamba_mode,
            req.num_spec,
        )

    async def _queue(self, agent: Agent, task: LayerTask) -> None:
        assert agent.stream is not None
        try:
            try:
                agent.stream.queue.put_nowait(task)
            except Exception:  # full: back-pressure the engine link without blocking the loop
                await asyncio.to_thread(agent.stream.put, task, self._settings.send_timeout_s)
        except BaseException:
            if task.release is not None:
                task.release()  # never queued: the engine must get its slot back
            raise

    def _event(
        self, agent: Agent, msg: LayerReady, by_peer: dict[str, list[StepRequest]]
    ) -> tuple[Event, Callable[[], None] | None]:
        """What the stream thread waits on before writing ``msg``'s layer, and how it gives
        the ring slot back afterwards."""
        if msg.slot < 0:
            return CpuEvent(), None  # the engine signalled a layer that is already complete
        ring = agent.events
        if ring is None:
            return RefusedEvent(
                f"layer {msg.layer} was signalled with event slot {msg.slot}, but rank "
                f"{msg.rank} registered no event ring; nothing was written for it"
            ), None
        try:
            ring.check(msg.layer, msg.slot, msg.seq)
        except KVSidecarError as e:
            return RefusedEvent(f"{e}; nothing was written for it"), None
        now = self._clock()
        deadline = now + self._settings.send_timeout_s
        ids = [s.request_id for steps in by_peer.values() for s in steps]
        deadlines = [r.deadline for rid in ids if (r := agent.sends.get(rid)) is not None]
        if deadlines:
            margin = min(_EVENT_MARGIN_S, self._settings.send_timeout_s / 10)
            deadline = min(deadline, max(now, min(deadlines) - margin))
        wait = RingWait(ring, msg.layer, msg.slot, msg.seq, deadline)
        return wait, wait.release

    def pin(self, agent: Agent, endpoint: str, ids: Sequence[str]) -> list[str]:
        """Stream thread: the requests that may be written to ``endpoint`` now."""
        if not self._peers.fresh(endpoint):
            # Not heard from within half a lease: it may already have declared us lost and
            # freed these blocks. End them rather than write late.
            self._call_soon(self._fail_stale, agent, endpoint, list(ids))
            return []
        out = []
        for rid in ids:
            req = agent.sends.get(rid)
            if req is not None and req.pin():
                out.append(rid)
        return out

    def unpin(self, agent: Agent, ids: Sequence[str]) -> None:
        """Stream thread: these writes left the wire."""
        for rid in ids:
            # Maybe reported already (its peer was lost): decode waits for this unpin.
            req = agent.recent(rid, SendRequest)
            if req is not None:
                req.unpin()
        self._call_soon(self._wake_drains)

    def _fail_stale(self, agent: Agent, endpoint: str, ids: list[str]) -> None:
        for rid in ids:
            req = agent.sends.get(rid)
            if req is not None:
                self.fail(req, f"decode peer {endpoint} not heard from recently; write not sent")

    def layer_done(self, agent: Agent, res: LayerResult) -> None:
        self._on_layer_latency(res.latency_s)
        stats = agent.groups[res.group]
        stats.bytes += res.bytes
        stats.descriptors += res.descriptors
        if res.descriptors:
            stats.layers_sent += 1
        stats.transfers_ok += bool(res.ok)
        stats.transfers_failed += bool(res.failed)
        for rid, err in res.failed.items():
            req = agent.sends.get(rid)
            if req is not None:
                self.fail(req, err)
        by_rank: dict[str, dict[int, int]] = {}
        for (rid, d_rank), nbytes in res.req_bytes.items():
            by_rank.setdefault(rid, {})[d_rank] = nbytes
        for rid in res.ok:
            req = agent.sends.get(rid)
            if req is None or req.state.terminal:
                continue
            written = by_rank.get(rid, {})
            for d_rank, nbytes in written.items():
                req.d_bytes[d_rank] = req.d_bytes.get(d_rank, 0) + nbytes
            req.bytes += sum(written.values())
            prog = req.groups.setdefault(res.group, GroupProgress())
            prog.layers_sent += 1
            nbytes = sum(written.values())
            prog.bytes += nbytes
            req.progressed(self._clock())
            if nbytes:  # a layer with nothing of it: no write
                end = res.started + res.latency_s
                req.timeline.written(res.step, res.layer, res.group, res.started, end, nbytes)
            # Only the final step's layers count: an earlier step's layers may still be on the
            # stream thread when the engine already signals the final step.
            if res.step == req.final_step and req.final_layers_left > 0:
                self.final_layer_written(req, res.layer)
                req.final_layers_left -= 1
                if req.final_layers_left == 0:
                    self._spawn(self.send_done(req))
