"""The sidecar process core: one Mooncake engine, the control port, the engine link, agents.

Everything that touches a request runs on the asyncio loop except the stream threads (planning
and the Mooncake writes), which hand results back with ``call_soon_threadsafe``. The request
state machines live in ``sending`` (prefill) and ``receiving`` (decode), the peer table with its
heartbeats in ``peers``, registrations and generations in ``registry``; this module owns
lifecycle and message dispatch.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from functools import partial
from typing import Any, Literal

import zmq.asyncio

from app.config import SidecarSettings
from app.errors import KVSidecarError, ProtocolError
from app.kvcache.desc import LayoutDesc
from app.store.pool_api import PoolConfig
from app.store.service import PoolService
from app.tracing.otel import open_tracing
from app.transfer.agent import Agent, RecvRequest, SendRequest, StreamThread, agent_of
from app.transfer.auth import load_auth
from app.transfer.control_server import ControlServer
from app.transfer.links import zmq_links
from app.transfer.mooncake import EngineConfig, MooncakeEngine
from app.transfer.peers import Peer, Peers, PeerSettings
from app.transfer.planner import PairPlanner
from app.transfer.pool_calls import pool_call
from app.transfer.protocol import (
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
    LayerReady,
    Msg,
    NewEpoch,
    Ping,
    Pong,
    PoolLoad,
    PoolLookup,
    PoolSave,
    RegisterEngine,
    Rejected,
    RemoteTarget,
    Reply,
    Role,
    SetTarget,
    SidecarInfo,
    SignedTargets,
    SignTargets,
    Status,
)
from app.transfer.receiving import RecvSettings, RecvSide
from app.transfer.registry import Registry, RegistrySettings
from app.transfer.sending import SendSettings, SendSide
from app.transfer.target_auth import TargetSigner
from app.transfer.traces import TransferTraces

log = logging.getLogger(__name__)

Observer = Callable[[float], None]
ObserverKind = Literal["layer", "handshake"]


class Sidecar:
    """Hosts the agents of the ranks in its pod."""

    def __init__(
        self,
        settings: SidecarSettings,
        *,
        engine_hook: Callable[[MooncakeEngine], None] | None = None,
    ) -> None:
        """``engine_hook`` (tests only) is called with the Mooncake engine once it is made."""
        self.settings = settings
        self._engine_hook = engine_hook
        self.started = time.time()
        self.ctx = zmq.asyncio.Context()
        self.agents: dict[int, Agent] = {}
        self.control: ControlServer | None = None
        self.engine_server: ControlServer | None = None
        self.control_endpoint = ""
        self.layer_latency: list[float] = []
        self._counters = {"expired": 0}
        self._observers: dict[ObserverKind, list[Observer]] = {"layer": [], "handshake": []}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._background: list[asyncio.Task[None]] = []
        # Set by every engine message (the only way requests are admitted): the deadline
        # watcher sleeps on it while nothing is in flight, so an idle sidecar does not poll.
        self._engine_spoke = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self._auth = load_auth(settings)
        self._targets = TargetSigner.of(self._auth)
        self._peers = Peers(
            PeerSettings(
                lease_s=settings.lease_s,
                heartbeat_interval_s=settings.heartbeat_interval_s,
                handshake_timeout_s=settings.handshake_timeout_s,
            ),
            zmq_links(self.ctx, self._auth, settings.control_max_frame_bytes),
            on_drop=self._close_lane,
            hello=self._hello_msg,
            make_planners=self._planners,
            on_lost=self._peer_lost,
            on_handshake=partial(self._observe, "handshake"),
        )
        self.send = SendSide(
            SendSettings(
                engine_id=settings.engine_id,
                send_timeout_s=settings.send_timeout_s,
                ack_timeout_s=settings.ack_timeout_s,
                max_target_timeout_s=settings.max_target_timeout_s,
                max_held_sends=settings.max_held_sends,
                max_held_blocks=settings.max_held_blocks,
            ),
            self.agents,
            self._peers,
            spawn=self._spawn,
            call_soon=self._call_soon,
            on_layer_latency=self._on_layer_latency,
            verify_target=self._targets.verify,
        )
        self.recv = RecvSide(
            RecvSettings(
                engine_id=settings.engine_id,
                recv_timeout_s=settings.recv_timeout_s,
                quarantine_max_s=settings.quarantine_max_s,
                heartbeat_interval_s=settings.heartbeat_interval_s,
            ),
            self.agents,
            self._peers,
            spawn=self._spawn,
            epoch=lambda: self.epoch,
        )
        self.registry = Registry(
            RegistrySettings(
                engine_id=settings.engine_id,
                ranks=tuple(settings.ranks),
                tp_size=settings.tp_size,
                device_type=settings.device_type,
                lease_s=settings.lease_s,
            ),
            self.agents,
            self._peers,
            stream_for=self._stream_for,
            drained=self.send.drained,
            control_port=lambda: self.control_port,
        )
        self.traces = TransferTraces(None, settings.engine_id)  # on at start, if configured

    # ---- hooks and views -------------------------------------------------------------------

    def add_observer(self, kind: ObserverKind, observe: Observer) -> Callable[[], None]:
        """Call ``observe`` with every layer write's or handshake's latency (seconds); returns
        a function that detaches it."""
        self._observers[kind].append(observe)
        return partial(self._observers[kind].remove, observe)

    def _observe(self, kind: ObserverKind, value: float) -> None:
        for observe in self._observers[kind]:
            observe(value)

    def _on_layer_latency(self, latency_s: float) -> None:
        self.layer_latency.append(latency_s)
        del self.layer_latency[:-4096]
        self._observe("layer", latency_s)

    @property
    def epoch(self) -> str:
        return self.registry.epoch

    @property
    def engine(self) -> MooncakeEngine | None:
        return self.registry.engine

    @property
    def pool(self) -> PoolService | None:
        return self.registry.pool

    @property
    def compat_hash(self) -> str:
        return self.registry.compat_hash

    @property
    def tp_size(self) -> int:
        return self.registry.tp_size

    @property
    def peers(self) -> dict[str, Peer]:
        return self._peers.table

    @property
    def admitting(self) -> bool:
        return self.send.admitting

    def stop_admitting(self) -> None:
        """New sends and receives are refused from now on (the first step of a shutdown)."""
        self.send.admitting = self.recv.admitting = False

    @property
    def counters(self) -> dict[str, int]:
        return {
            **self._counters,
            **self._peers.counters,
            **self.recv.counters,
            "generations": self.registry.generation,
            "unconfirmed_sends": self.send.unconfirmed,
        }

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
                )
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

    def info(self) -> dict[str, str | int | float | bool | None]:
        """What an engine hands its router so that a prefill sidecar can reach this one."""
        ready, why = self.ready
        return {
            "epoch": self.epoch,
            "host": self.settings.resolved_advertise_host(),
            "port": self.control_port,
            "engine_id": self.settings.engine_id,
            "tp_size": self.tp_size,
            "ready": ready,
            "why": why,
        }

    def sign_target(self, target: RemoteTarget) -> RemoteTarget:
        """``target`` signed, if it names this sidecar as it runs now; raises ProtocolError
        otherwise (a signed target must not point prefill at another host)."""
        own = (
            self.settings.engine_id,
            self.epoch,
            self.settings.resolved_advertise_host(),
            self.control_port,
        )
        named = (target.engine_id, target.epoch, target.host, target.port)
        if named != own:
            raise ProtocolError(
                f"target for {target.request_id}: expected this sidecar's engine id, epoch, "
                f"host and control port {own}, got {named}; not signed"
            )
        return self._targets.sign(target)

    @property
    def control_port(self) -> int:
        return int(self.control_endpoint.rsplit(":", 1)[1])

    @property
    def ready(self) -> tuple[bool, str]:
        """Ready once every configured rank registered its memory and the ports are bound."""
        if self.control is None or self.engine is None:
            return False, "starting: control port not bound yet"
        missing = [
            r
            for r in self.settings.ranks
            if r not in self.agents or self.agents[r].epoch != self.epoch
        ]
        if missing:
            return False, f"waiting for engine ranks {missing} to register their KV caches"
        return True, "ready"

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

    def _live_requests(self) -> bool:
        return any(not r.state.terminal for a in self.agents.values() for r in a.all_requests())

    async def abort(self, rank: int, rid: str, reason: str) -> bool:
        """End ``rid`` on ``rank`` as ABORTED and tell its peer; False if it had already ended.

        Raises when telling the peer failed (the request is aborted here all the same)."""
        agent = agent_of(self.agents, rank)
        if rid in agent.sends:
            return await self.send.abort(rank, rid, reason, notify=True)
        return await self.recv.abort(rank, rid, reason)

    def set_target(self, rid: str, remote: RemoteTarget) -> dict[int, str | None]:
        """Decode's target for a send admitted without one, on every rank that holds it (the
        prefill-first flow, where decode posts it here). Rank -> None if taken, else why not;
        raises AuthError for a target decode's sidecar did not sign (the send keeps waiting
        for the real one), ProtocolError when the target does not fit the send."""
        self._targets.verify(remote)
        holding = [rank for rank, agent in sorted(self.agents.items()) if rid in agent.sends]
        for rank in holding:  # all checked before any takes it: a bad target is nobody's
            self.send.check_target(rank, rid, remote)
        out: dict[int, str | None] = {}
        for rank in holding:
            reply = self.send.set_target(SetTarget(rank=rank, request=rid, remote=remote))
            out[rank] = None if reply.ok else reply.error
        return out

    # ---- engine link -----------------------------------------------------------------------

    async def _on_engine(self, msg: AnyMsg, ident: bytes) -> Msg | None:
        self._engine_spoke.set()
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
            if isinstance(msg, PoolLookup | PoolSave | PoolLoad):
                return await pool_call(self.pool, msg)
        except KVSidecarError as e:
            return Reply(ok=False, error=str(e))
        return Error(reason=f"unexpected message {type(msg).__name__} on the engine link")

    def _stream_for(self, agent: Agent) -> StreamThread:
        assert self.engine is not None
        return StreamThread(
            f"stream-{agent.rank}",
            self.settings.stream_queue_depth,
            self.engine.write_sync,
            partial(self._call_soon, self.send.layer_done, agent),
            partial(self.send.pin, agent),
            partial(self.send.unpin, agent),
        )

    # ---- control port ----------------------------------------------------------------------

    async def _on_peer(self, msg: AnyMsg, ident: bytes) -> Msg | None:
        if isinstance(msg, Ping):
            return Pong(epoch=self.epoch, known=self._peers.heard(msg.engine_id, msg.epoch))
        if isinstance(msg, Hello):
            return self._hello(msg)
        if isinstance(msg, Claim):
            return self.recv.claim(msg)
        if isinstance(msg, Done):
            return self.recv.done(msg)
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

    def _hello_msg(self, request: str = "") -> Hello:
        return Hello(
            request=request,
            compat_hash=self.compat_hash,
            engine_id=self.settings.engine_id,
            role=Role.PREFILL if self.settings.role == "prefill" else Role.BOTH,
            epoch=self.epoch,
            control=f"tcp://{self.settings.resolved_advertise_host()}:{self.control_port}",
            speculative=self.registry.speculative,
        )

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

    def _planners(self, descs: dict[int, LayoutDesc]) -> dict[int, PairPlanner]:
        return {rank: PairPlanner(agent.desc, descs) for rank, agent in self.agents.items()}

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

    async def _close_lane(self, peer: Peer) -> None:
        # A forgotten peer keeps no sending engine (3 threads, 6 fds) behind. In the
        # background: closing waits for the lane's writes, 30 s to a frozen peer.
        engine = self.engine
        if peer.te_session and engine is not None:

            async def close() -> None:
                await asyncio.to_thread(engine.close_lane, peer.te_session)

            self._spawn(close())

    async def _peer_lost(self, peer: Peer, reason: str) -> None:
        self.recv.peer_lost(peer, reason)
        await self.send.peer_lost(peer, reason)

    # ---- background ------------------------------------------------------------------------

    async def _watch_deadlines(self) -> None:
        """Deadlines: every wait ends, in EXPIRED, even when the peer vanished."""
        while True:
            self._engine_spoke.clear()
            if not self._live_requests():
                await self._engine_spoke.wait()
                continue
            await asyncio.sleep(0.05)
            now = time.monotonic()
            for agent in list(self.agents.values()):
                for req in agent.all_requests():
                    if req.state.terminal or now <= req.deadline:
                        continue
                    if isinstance(req, SendRequest):
                        ended = self.send.fail(req, "deadline passed while sending", Status.EXPIRED)
                    elif isinstance(req, RecvRequest):
                        ended = self.recv.end(
                            req, Status.EXPIRED, "deadline passed while waiting for prefill"
                        )
                    self._counters["expired"] += ended

    async def _heartbeats(self) -> None:
        while True:
            await asyncio.sleep(self.settings.heartbeat_interval_s)
            try:
                in_use = self.send.live_peers() | self.recv.live_peers()
                await self._peers.heartbeat(in_use, self.settings.engine_id, self.epoch)
            except Exception:  # the heartbeat must outlive any one bad round
                log.exception("heartbeat round failed")

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _call_soon(self, fn: Callable[..., None], *args: Any) -> None:
        """Run ``fn`` on the loop, from any thread."""
        assert self._loop is not None
        self._loop.call_soon_threadsafe(fn, *args)
