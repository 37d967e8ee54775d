"""The sidecar process core: one Mooncake engine, the control port, the engine link, agents.

Everything that touches a request runs on the asyncio loop except the stream threads (planning
and the Mooncake writes), which hand results back with ``call_soon_threadsafe``. The request
state machines live in ``requests`` (``sending`` for prefill, ``receiving`` for decode,
registrations and generations in ``registry``), the peer table with its heartbeats in
``control.peers``; ``core`` builds the parts and wires them together, and this module owns
lifecycle and message dispatch.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time

from app.errors import KVSidecarError
from app.store.pool_api import PoolConfig
from app.store.service import PoolService
from app.tracing.otel import open_tracing
from app.transfer.control.server import ControlServer
from app.transfer.lanes.mooncake import EngineConfig, MooncakeEngine
from app.transfer.requests.agent import agent_of
from app.transfer.requests.pool_calls import pool_call
from app.transfer.sidecar.core import SidecarCore
from app.transfer.wire.protocol import (
    Abort,
    AbortRequest,
    Ack,
    AddSend,
    AgentMetadata,
    AnyMsg,
    BeginStep,
    Claim,
    Done,
    EndStep,
    Error,
    ExpectRecv,
    Finished,
    GetFinished,
    Hello,
    LayerDigests,
    LayerReady,
    Msg,
    NewEpoch,
    Ping,
    Pong,
    PoolLoad,
    PoolLookup,
    PoolPoll,
    PoolSave,
    RegisterEngine,
    Rejected,
    Reply,
    SetTarget,
    SidecarInfo,
    SignedTargets,
    SignTargets,
    Status,
)

log = logging.getLogger(__name__)

# The deadline watcher runs at most this often (expiry lags a deadline by up to this much),
# and sleeps at most this long.
_WATCH_GAP_S = 0.05
_WATCH_NAP_S = 1.0
# Engine messages that never start a request: they do not wake the idle deadline watcher (an
# engine polls GetFinished every step, and 100 times a second while decode waits for KV).
_NO_NEW_REQUESTS = (GetFinished, EndStep, LayerReady, SidecarInfo)


class Sidecar(SidecarCore):
    """Hosts the agents of the ranks in its pod."""

    # ---- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        s = self.settings
        self.traces.tracing = open_tracing(f"kv-sidecar-{s.role}")
        engine = self.registry.engine = await asyncio.to_thread(
            MooncakeEngine,
            EngineConfig(
                host=s.resolved_advertise_host(),
                protocol=s.transport,
                device_name=s.device_name,
                max_descriptors_per_submit=s.max_descriptors_per_submit,
                spin_threads=s.spin_threads,
                wait=s.write_wait,
            ),
        )
        if s.pool.enabled:
            pool = self.registry.pool = PoolService(
                PoolConfig(
                    master_address=s.pool.master_address,
                    local_hostname=s.resolved_advertise_host(),
                    metadata_server=s.pool.metadata_server,
                    global_segment_size=s.pool.global_segment_bytes,
                    local_buffer_size=s.pool.local_buffer_bytes,
                    protocol=s.transport,
                    rdma_devices=s.device_name,
                    quarantine_max_s=s.quarantine_max_s,
                ),
                tails=s.pool.tails,
                namespace=s.pool.namespace,
                digest=self.digest,
            )
            await pool.start()
        if self._engine_hook is not None:
            self._engine_hook(engine)
        self.control = ControlServer(
            self.ctx,
            f"tcp://{s.control_host}:{s.control_port}",
            self._on_peer,
            name="control",
            auth=self._auth,
            max_frame_bytes=s.control_max_frame_bytes,
        )
        self.control_endpoint = await self.control.start()
        self.engine_server = ControlServer(
            self.ctx,
            s.engine_ipc,
            self._on_engine,
            name="engine",
            inline=(GetFinished, BeginStep, EndStep),
            max_frame_bytes=s.engine_max_frame_bytes,
        )
        await self.engine_server.start()
        self._background = [
            asyncio.create_task(self._watch_deadlines()),
            asyncio.create_task(self._heartbeats()),
        ]
        log.info(
            "sidecar %s epoch %s control %s engine %s",
            s.engine_id,
            self.epoch,
            self.control_endpoint,
            s.engine_ipc,
        )

    async def stop(self, grace_s: float | None = None) -> dict[str, int]:
        """Stop admitting, let in-flight requests end within the grace period, abort the rest
        (prefill tells decode once its writes drained; decode asks prefill to drain)."""
        self.stop_admitting()
        grace = self.settings.shutdown_grace_s if grace_s is None else grace_s
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and self._live_requests():
            await asyncio.sleep(0.05)
        reason = "sidecar shutting down"
        aborted = [
            self.abort(a.rank, r.id, reason)
            for a in self.agents.values()
            for r in a.all_requests()
            if not r.state.terminal
        ]
        done = await asyncio.gather(*aborted, return_exceptions=True)
        # Decode would otherwise hold the blocks until its own deadline (measured: 29 s).
        report = {
            "done": sum(
                1 for a in self.agents.values() for r in a.history if r.state is Status.DONE
            ),
            "aborted": sum(1 for d in done if d is not False),
        }
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for a in self.agents.values():
            if a.stream:
                await asyncio.to_thread(a.stream.stop)
        for task in self._background:
            task.cancel()
        for server in (self.control, self.engine_server):
            if server:
                await server.stop()
        await self._peers.close()
        if self.pool is not None:
            await self.pool.stop()
        if self.engine:
            await asyncio.to_thread(self.engine.close)
        await asyncio.to_thread(self.traces.close)  # exports the spans still buffered
        self.ctx.term()
        return report

    # ---- engine link -----------------------------------------------------------------------

    async def _on_engine(self, msg: AnyMsg, ident: bytes) -> Msg | None:
        if not isinstance(msg, _NO_NEW_REQUESTS):
            self._deadlines_moved.set()  # the deadline watcher may have requests to watch now
        try:
            if isinstance(msg, LayerReady):
                await self.send.layer_ready(msg)
                return None
            if isinstance(msg, RegisterEngine):
                return await self.registry.register_engine(msg.registration)
            if isinstance(msg, AddSend):
                return await self.send.add(msg)
            if isinstance(msg, SetTarget):
                return self.send.set_target(msg)
            if isinstance(msg, ExpectRecv):
                return self.recv.expect(msg)
            if isinstance(msg, BeginStep):
                # Inline, in the order the engine sent it: expects, then admissions, then the
                # step's slices; the step's LayerReady messages come after.
                for e in msg.expects:
                    self.recv.expect(e, report=True)
                for a in msg.admits:
                    self.send.admit(a)
                self.send.begin_step(msg)
                return Reply()
            if isinstance(msg, EndStep):
                agent_of(self.agents, msg.rank).step_log.forward_ended(msg.step, time.monotonic())
                return Reply()
            if isinstance(msg, GetFinished):
                agent = agent_of(self.agents, msg.rank)
                sending, recving, failed = agent.finished()
                if self.traces.tracing is not None:
                    # Off the loop: a long chunked prefill makes hundreds of write spans.
                    ended = agent.reported(sending, recving, failed)
                    asyncio.get_running_loop().run_in_executor(None, self.traces.ended, ended)
                return Finished(
                    sending=sending,
                    recving=recving,
                    failed=failed,
                    bytes=sum(g.bytes for g in agent.groups.values()),
                    descriptors=sum(g.descriptors for g in agent.groups.values()),
                    totals=agent.totals(sending, recving, failed),
                )
            if isinstance(msg, SidecarInfo):
                return Reply(data=self.info())
            if isinstance(msg, SignTargets):
                return SignedTargets(targets=[self.sign_target(t) for t in msg.targets])
            if isinstance(msg, AbortRequest):
                await self.abort(msg.rank, msg.request, msg.reason)
                return Reply()
            if isinstance(msg, PoolLookup | PoolSave | PoolLoad | PoolPoll):
                return await pool_call(self.pool, msg)
        except KVSidecarError as e:
            return Reply(ok=False, error=str(e))
        return Error(reason=f"unexpected message {type(msg).__name__} on the engine link")

    # ---- control port ----------------------------------------------------------------------

    async def _on_peer(self, msg: AnyMsg, ident: bytes) -> Msg | None:
        if isinstance(msg, Ping):
            known = self._peers.heard(msg.engine_id, msg.epoch)
            if known and msg.sending:
                self.recv.still_sending(msg.engine_id, msg.sending)
            return Pong(epoch=self.epoch, known=known)
        if isinstance(msg, Hello):
            return self._hello(msg)
        if isinstance(msg, Claim):
            self._deadlines_moved.set()  # a claim may bring the receive's deadline sooner
            return self.recv.claim(msg)
        if isinstance(msg, Done):
            return await self.recv.done_checked(msg)
        if isinstance(msg, LayerDigests):
            return await self.recv.layer_digests(msg)
        if isinstance(msg, Abort):
            # From prefill (it ended a send; drained) or from decode (asks us to drain).
            self.recv.aborted_by_prefill(msg.request, msg.sender_engine, msg.reason)
            await self.send.aborted_by_decode(msg.request, msg.sender_engine, msg.reason)
            return Ack(request=msg.request)
        if isinstance(msg, NewEpoch):
            peer = self._peers.by_engine(msg.engine_id)
            if peer is not None:
                why = f"peer {msg.engine_id} started a new generation (epoch {msg.new})"
                # It drained its writes to us before it told us.
                self.recv.peer_lost(peer, why, stopped=True)
                await self.send.peer_lost(peer, why, epoch=msg.old)
                await self._peers.drop(peer)
            return Ack(request="")
        return Error(reason=f"unexpected message {type(msg).__name__} on the control port")

    def _refusal(self, msg: Hello) -> str | None:
        """Why a prefill's handshake is refused (None: it is not)."""
        ok, why = self.ready
        if not ok:
            return f"decode sidecar not ready: {why}"
        if msg.speculative != self.registry.speculative:
            # Checked first: a drafter's layers change the compat hash too, and this says why.
            return (
                f"speculative decoding differs: prefill {msg.speculative or 'off'}, decode "
                f"{self.registry.speculative or 'off'}; both engines need the same "
                "--speculative-config (method, draft, num_speculative_tokens)"
            )
        if msg.compat_hash != self.compat_hash:
            return (
                f"model mismatch: prefill compat hash {msg.compat_hash}, decode "
                f"{self.compat_hash}; run the same preset, dtype and layer count on both"
            )
        return None

    def _hello(self, msg: Hello) -> Msg:
        why = self._refusal(msg)
        if why is not None:
            if msg.request:
                self.recv.refused(msg.request, msg.engine_id, why)
            return Rejected(reason=why)
        self._peers.met(msg)
        assert self.engine is not None
        return AgentMetadata(
            engine_id=self.settings.engine_id,
            epoch=self.epoch,
            tp_size=self.tp_size,
            te_session=self.engine.session_id,
            ranks=[a.desc for a in self.agents.values()],
        )

    # ---- background ------------------------------------------------------------------------

    async def _watch_deadlines(self) -> None:
        """Deadlines: every wait ends, in EXPIRED, even when the peer vanished.

        Sleeps until the earliest deadline has passed, or until a message may have brought
        one sooner, and runs at most every ``_WATCH_GAP_S``. It used to poll every 50 ms while
        any request was in flight: 20 wakeups a second through a long prefill, each costing a
        VM's wakeup price (0.1-0.6 ms of CPU) on both sidecars."""
        last = -math.inf
        while True:
            gap = time.monotonic() - last
            if gap < _WATCH_GAP_S:
                await asyncio.sleep(_WATCH_GAP_S - gap)
            self._deadlines_moved.clear()
            last = now = time.monotonic()
            self._counters["expired"] += self.send.expire(now) + self.recv.expire(now)
            soonest = self._next_deadline()
            if soonest is None:
                await self._deadlines_moved.wait()
                continue
            # Past the deadline by a hair: expiry is ``now > deadline``. At most _WATCH_NAP_S
            # asleep, should a path that brings a deadline sooner not say so.
            nap = min(max(soonest - now, 0.0) + 1e-3, _WATCH_NAP_S)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._deadlines_moved.wait(), nap)

    async def _heartbeats(self) -> None:
        while True:
            await asyncio.sleep(self.settings.heartbeat_interval_s)
            try:
                in_use = self.send.live_peers() | self.recv.live_peers()
                await self._peers.heartbeat(
                    in_use, self.settings.engine_id, self.epoch, self.send.sending_to
                )
            except Exception:  # the heartbeat must outlive any one bad round
                log.exception("heartbeat round failed")
