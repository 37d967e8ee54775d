"""The sidecar process core: one Mooncake engine, the control port, the engine link, agents.

Everything that touches a request runs on the asyncio loop except the stream threads (planning
and the Mooncake writes), which hand results back with ``call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np
import zmq.asyncio

from app.config import SidecarSettings
from app.devices import CpuEvent
from app.engine_link.shm import attach_allocator, map_engine_file
from app.errors import (
    ConfigError,
    DeadlineExceeded,
    KVSidecarError,
    LayoutMismatchError,
    OutOfBoundsError,
    ProtocolError,
)
from app.kvcache.desc import LayoutDesc, describe
from app.kvcache.engine_layout import describe_engine
from app.kvcache.engine_spec import EngineRegistration
from app.kvcache.groups import build_cache_config
from app.kvcache.layout import KVLayout, LayoutMode, allocate
from app.kvcache.presets import load_preset
from app.store.pool import PoolConfig
from app.store.service import PoolService, RankPool
from app.transfer.agent import (
    ALL_LAYERS,
    Agent,
    GroupProgress,
    LayerResult,
    LayerTask,
    RecvRequest,
    SendRequest,
    StepState,
    StreamThread,
    receive_manifest,
)
from app.transfer.control import ControlServer, PeerClient
from app.transfer.mooncake import EngineConfig, MooncakeEngine
from app.transfer.planner import MambaMode, PairPlanner, StepRequest, check_block_ids
from app.transfer.protocol import (
    Abort,
    AbortRequest,
    Ack,
    AddSend,
    AgentMetadata,
    AnyMsg,
    BeginStep,
    Done,
    Error,
    ExpectRecv,
    Finished,
    GetFinished,
    Hello,
    LayerReady,
    Msg,
    PoolLoad,
    PoolLoaded,
    PoolLookup,
    PoolSave,
    RegisterCaches,
    RegisterEngine,
    Rejected,
    Reply,
    Role,
    SidecarInfo,
    Status,
    layout_desc,
    rank_metadata,
)

log = logging.getLogger(__name__)

FAULT_ENV = "KV_SIDECAR_FAULT_FAIL_WRITES"  # test hook: fail the next N Mooncake writes


@dataclass
class Peer:
    """A remote sidecar (decode side) as this one knows it, keyed by its control address."""

    endpoint: str
    client: PeerClient
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    epoch: str = ""
    engine_id: str = ""
    te_session: str = ""
    descs: dict[int, LayoutDesc] = field(default_factory=dict)
    planners: dict[int, PairPlanner] = field(default_factory=dict)
    handshakes: int = 0
    failures: int = 0
    last_handshake: float | None = None
    last_error: str = ""


def _blocks(ids: Sequence[Sequence[int]]) -> tuple[np.ndarray, ...]:
    return tuple(np.asarray(x, dtype=np.int64) for x in ids)


class Sidecar:
    """Hosts the agents of the ranks in its pod."""

    def __init__(self, settings: SidecarSettings) -> None:
        self.settings = settings
        self.epoch = secrets.token_hex(8)
        self.started = time.time()
        self.ctx = zmq.asyncio.Context()
        self.engine: MooncakeEngine | None = None
        self.pool: PoolService | None = None
        self.agents: dict[int, Agent] = {}
        self.peers: dict[str, Peer] = {}
        self.control: ControlServer | None = None
        self.engine_server: ControlServer | None = None
        self.control_endpoint = ""
        self.compat_hash = ""
        self.tp_size = settings.tp_size
        self.admitting = True
        self.counters = {"rejected_frames": 0, "handshakes": 0, "expired": 0, "duplicate_dones": 0}
        self.layer_latency: list[float] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._watchdog: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    # ---- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        s = self.settings
        self.engine = await asyncio.to_thread(
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
            self.pool = PoolService(
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
            await self.pool.start()
        faults = int(os.environ.get(FAULT_ENV, "0") or 0)
        if faults:
            self.engine.inject_failures(faults)
        self.control = ControlServer(
            self.ctx, f"tcp://{s.control_host}:{s.control_port}", self._on_peer, name="control"
        )
        self.control_endpoint = await self.control.start()
        self.engine_server = ControlServer(
            self.ctx, s.engine_ipc, self._on_engine, name="engine", inline=(GetFinished, BeginStep)
        )
        await self.engine_server.start()
        self._watchdog = asyncio.create_task(self._watch())
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

    @property
    def control_port(self) -> int:
        return int(self.control_endpoint.rsplit(":", 1)[1])

    @property
    def ready(self) -> tuple[bool, str]:
        """Ready once every configured rank registered its memory and the ports are bound."""
        if self.control is None or self.engine is None:
            return False, "starting: control port not bound yet"
        missing = [r for r in self.settings.ranks if r not in self.agents]
        if missing:
            return False, f"waiting for engine ranks {missing} to register their KV caches"
        return True, "ready"

    async def stop(self, grace_s: float | None = None) -> dict[str, int]:
        """Stop admitting, let in-flight requests end within the grace period, abort the rest."""
        self.admitting = False
        grace = self.settings.shutdown_grace_s if grace_s is None else grace_s
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(
            not r.state.terminal for a in self.agents.values() for r in a.all_requests()
        ):
            await asyncio.sleep(0.05)
        aborted = 0
        told: set[tuple[str, str]] = set()  # (peer, request): every P rank holds its own entry
        for a in self.agents.values():
            for r in a.all_requests():
                if r.finish(Status.ABORTED, "sidecar shutting down"):
                    aborted += 1
                    if isinstance(r, SendRequest) and r.peer in self.peers:
                        told.add((r.peer, r.id))
        # Decode would otherwise hold the blocks until its own deadline (measured: 29 s).
        await self._tell_peers_aborted(told, "prefill sidecar shutting down")
        report = {
            "done": sum(
                1 for a in self.agents.values() for r in a.history if r.state is Status.DONE
            ),
            "aborted": aborted,
        }
        for a in self.agents.values():
            if a.stream:
                await asyncio.to_thread(a.stream.stop)
        if self._watchdog:
            self._watchdog.cancel()
        for server in (self.control, self.engine_server):
            if server:
                await server.stop()
        for p in self.peers.values():
            await p.client.close()
        if self.pool is not None:
            await self.pool.stop()
        if self.engine:
            await asyncio.to_thread(self.engine.close)
        self.ctx.term()
        return report

    # ---- engine link -----------------------------------------------------------------------

    async def _on_engine(self, msg: AnyMsg, ident: bytes) -> Msg | None:
        try:
            if isinstance(msg, LayerReady):
                await self._layer_ready(msg)
                return None
            if isinstance(msg, RegisterCaches):
                return await self._register(msg)
            if isinstance(msg, RegisterEngine):
                return await self._register_engine(msg.registration)
            if isinstance(msg, AddSend):
                return await self._add_send(msg)
            if isinstance(msg, ExpectRecv):
                return self._expect(msg)
            if isinstance(msg, BeginStep):
                return self._begin_step(msg)
            if isinstance(msg, GetFinished):
                agent = self._agent(msg.rank)
                sending, recving, failed = agent.finished()
                return Finished(
                    sending=sending,
                    recving=recving,
                    failed=failed,
                    bytes=sum(g.bytes for g in agent.groups.values()),
                    descriptors=sum(g.descriptors for g in agent.groups.values()),
                )
            if isinstance(msg, SidecarInfo):
                return Reply(data=self.info())
            if isinstance(msg, AbortRequest):
                await self._abort(msg.rank, msg.request, msg.reason, notify=True)
                return Reply()
            if isinstance(msg, PoolLookup | PoolSave | PoolLoad):
                return await self._pool_call(msg)
        except KVSidecarError as e:
            return Reply(ok=False, error=str(e))
        return Error(reason=f"unexpected message {type(msg).__name__} on the engine link")

    async def _pool_call(self, msg: PoolLookup | PoolSave | PoolLoad) -> Msg:
        if self.pool is None:
            return Reply(
                ok=False,
                error="the KV pool is not enabled on this sidecar; set "
                "KVSIDECAR_POOL__ENABLED=true and the master address",
            )
        if isinstance(msg, PoolLookup):
            hit = await self.pool.lookup(msg.rank, msg.token_ids, msg.extra_keys)
            return Reply(data={"hit_tokens": hit.hit_tokens})
        if isinstance(msg, PoolSave):
            saved = await self.pool.save(
                msg.rank, msg.token_ids, _blocks(msg.block_ids), msg.num_computed, msg.extra_keys
            )
            return Reply(
                data={
                    "stored": saved.stored,
                    "skipped": saved.skipped,
                    "backpressure": saved.backpressure,
                    "failed": saved.failed,
                    "bytes": saved.bytes,
                }
            )
        loaded = await self.pool.load(
            msg.rank, msg.token_ids, _blocks(msg.block_ids), msg.hit_tokens, msg.extra_keys
        )
        return PoolLoaded(
            loaded=loaded.loaded, bytes=loaded.bytes, failed_blocks=loaded.failed_blocks
        )

    def _agent(self, rank: int) -> Agent:
        agent = self.agents.get(rank)
        if agent is None:
            raise ProtocolError(f"rank {rank} has not registered its KV caches with this sidecar")
        return agent

    async def _register(self, msg: RegisterCaches) -> Msg:
        model = load_preset(
            msg.model, layers=msg.layers, dtype=msg.dtype, cache_dtype=msg.cache_dtype
        )
        if self.compat_hash and model.compat_hash() != self.compat_hash:
            return Reply(ok=False, error="rank registered a different model than its siblings")
        config = build_cache_config(model, msg.tp_size, msg.block_size, num_blocks=msg.num_blocks)
        layout = allocate(
            config,
            msg.rank,
            mode=LayoutMode(msg.layout_mode),
            kv_layout=KVLayout(msg.kv_layout),
            heads_major=msg.heads_major,
            allocator=attach_allocator(msg.shm_names),
        )
        assert self.engine is not None
        await asyncio.to_thread(self.engine.register_many, layout.spans())
        if self.pool is not None:
            await self.pool.register(RankPool.from_layout(layout))
        await self._install(Agent(layout, describe(layout), msg.engine_id))
        self.compat_hash = model.compat_hash()
        self.tp_size = msg.tp_size
        return Reply(
            data={
                "epoch": self.epoch,
                "control_port": self.control_port,
                "num_blocks": config.num_blocks,
            }
        )

    async def _register_engine(self, reg: EngineRegistration) -> Msg:
        """Regions, groups and pieces from the engine's own tensors (DESIGN §2a)."""
        self._check_rank(reg.rank)
        buffers = [map_engine_file(span.name, span.offset + span.size) for span in reg.memory]
        desc = describe_engine(
            reg, [b.data_ptr() + s.offset for b, s in zip(buffers, reg.memory, strict=True)]
        )
        if self.compat_hash and desc.compat_hash != self.compat_hash:
            return Reply(
                ok=False,
                error=f"rank {reg.rank} registered model {desc.compat_hash}, its siblings "
                f"{self.compat_hash}; every rank of one sidecar must run the same model",
            )
        assert self.engine is not None
        spans = [
            (b.data_ptr() + s.offset, s.size) for b, s in zip(buffers, reg.memory, strict=True)
        ]
        await asyncio.to_thread(self.engine.register_many, spans)
        if self.pool is not None:
            await self.pool.register(RankPool.from_engine(desc, reg, spans))
        agent = Agent(None, desc, reg.engine_id)
        agent.memory = buffers  # the mappings live as long as the agent
        agent.registration = reg
        await self._install(agent)
        self.compat_hash = desc.compat_hash
        self.tp_size = reg.tp_size
        log.info(
            "rank %d registered %s: %d layers in %d groups, %d blocks, %d regions",
            reg.rank,
            reg.model,
            len(desc.placements),
            len(desc.groups),
            desc.num_blocks,
            len(desc.regions),
        )
        return Reply(
            data={
                "epoch": self.epoch,
                "control_port": self.control_port,
                "num_blocks": desc.num_blocks,
                "compat_hash": desc.compat_hash,
            }
        )

    def _check_rank(self, rank: int) -> None:
        if rank not in self.settings.ranks:
            raise ConfigError(
                f"rank {rank} registered, this sidecar hosts ranks {self.settings.ranks}; "
                "set the sidecar's ranks to the engine ranks in its pod"
            )

    async def _install(self, agent: Agent) -> None:
        loop = self._loop
        assert self.engine is not None
        assert loop is not None
        agent.stream = StreamThread(
            f"stream-{agent.rank}",
            self.settings.stream_queue_depth,
            self.engine.write_sync,
            partial(_threadsafe, loop, partial(self._layer_done, agent)),
            partial(_is_live, agent),
            partial(_threadsafe, loop, partial(self._pin, agent)),
        )
        old = self.agents.pop(agent.rank, None)
        if old and old.stream:
            await asyncio.to_thread(old.stream.stop)
        self.agents[agent.rank] = agent

    def _begin_step(self, msg: BeginStep) -> Msg:
        agent = self._agent(msg.rank)
        for s in msg.slices:
            req = agent.sends.get(s.request)
            if s.block_ids is None or req is None or req.state.terminal:
                continue
            blocks = _blocks(s.block_ids)
            try:
                check_block_ids(agent.desc, blocks, "prefill")
            except OutOfBoundsError as e:
                if req.finish(Status.FAILED, str(e)):
                    self._spawn(self._send_done(req))
                continue
            req.blocks = blocks
        agent.steps[msg.step] = StepState([(s.request, s.start, s.end) for s in msg.slices])
        return Reply()

    def _pin(self, agent: Agent, ids: Sequence[str], delta: int) -> None:
        for rid in ids:
            req = agent.sends.get(rid)
            if req is not None:
                req.inflight += delta

    # ---- send side -------------------------------------------------------------------------

    async def _peer(self, host: str, port: int, epoch: str) -> Peer:
        endpoint = f"tcp://{host}:{port}"
        peer = self.peers.get(endpoint)
        if peer is None:
            peer = self.peers[endpoint] = Peer(endpoint, PeerClient(self.ctx, endpoint))
        async with peer.lock:
            if not peer.planners or (epoch and epoch != peer.epoch):
                try:
                    await self._handshake(peer)
                except KVSidecarError:
                    # A peer that never answered keeps nothing here: no entry, no socket
                    # (measured: 100 dead targets had left 100 entries and their fds).
                    if not peer.planners and self.peers.get(endpoint) is peer:
                        del self.peers[endpoint]
                        await peer.client.close()
                    raise
        if epoch and epoch != peer.epoch:
            raise LayoutMismatchError(
                f"decode sidecar {endpoint} restarted: the request targets epoch {epoch}, the "
                f"sidecar now runs epoch {peer.epoch}; re-admit the request at decode"
            )
        return peer

    async def _handshake(self, peer: Peer) -> None:
        t0 = time.monotonic()
        role = Role.PREFILL if self.settings.role == "prefill" else Role.BOTH
        hello = Hello(
            compat_hash=self.compat_hash,
            engine_id=self.settings.engine_id,
            role=role,
            epoch=self.epoch,
        )
        try:
            reply = await peer.client.request(hello, self.settings.handshake_timeout_s)
        except DeadlineExceeded as e:
            peer.failures += 1
            peer.last_error = str(e)
            raise
        if isinstance(reply, Rejected | Error):
            peer.failures += 1
            peer.last_error = reply.reason
            raise LayoutMismatchError(f"decode sidecar {peer.endpoint} rejected us: {reply.reason}")
        if not isinstance(reply, AgentMetadata):
            raise ProtocolError(f"expected AgentMetadata, got {type(reply).__name__}")
        descs = {m.rank: layout_desc(m) for m in reply.ranks}
        planners = {}
        for rank, agent in self.agents.items():
            try:
                planners[rank] = PairPlanner(agent.desc, descs)
            except LayoutMismatchError as e:
                peer.failures += 1
                peer.last_error = str(e)
                raise
        peer.epoch, peer.engine_id, peer.te_session = reply.epoch, reply.engine_id, reply.te_session
        peer.descs, peer.planners = descs, planners
        peer.handshakes += 1
        peer.last_handshake = time.time()
        self.counters["handshakes"] += 1
        self.handshake_latency = time.monotonic() - t0
        for observe in getattr(self, "handshake_latency_observers", ()):  # admin API histogram
            observe(self.handshake_latency)

    async def _add_send(self, msg: AddSend) -> Msg:
        agent = self._agent(msg.rank)
        if not self.admitting:
            return Reply(ok=False, error="sidecar is shutting down; not admitting requests")
        if msg.request in agent.sends:
            return Reply(ok=False, error=f"request {msg.request} is already in flight")
        t = msg.remote
        req = SendRequest(
            id=msg.request,
            rank=msg.rank,
            prompt_len=msg.prompt_len,
            blocks=_blocks(msg.block_ids),
            deadline=time.monotonic() + self.settings.send_timeout_s,
            peer=f"tcp://{t.host}:{t.port}",
            d_blocks=_blocks(t.block_ids),
            target_epoch=t.epoch,
            mamba_mode=MambaMode(msg.mamba_mode),
            num_spec=msg.num_spec,
        )
        agent.sends[req.id] = req
        try:
            check_block_ids(agent.desc, req.blocks, "prefill")
            peer = await self._peer(t.host, t.port, t.epoch)
            planner = peer.planners[msg.rank]
            # Known before the id check, so that D hears of a refusal instead of expiring.
            req.d_ranks = {
                d: frozenset(
                    pl.group
                    for pl in agent.desc.placements
                    if planner.template(pl.layer, d)[0].size
                )
                for d in planner.peers()
            }
            check_block_ids(next(iter(peer.descs.values())), req.d_blocks, "decode")
        except (KVSidecarError, ValueError) as e:
            req.finish(Status.FAILED, str(e))
            self._spawn(self._send_done(req))
            return Reply(ok=False, error=str(e))
        return Reply()

    async def _layer_ready(self, msg: LayerReady) -> None:
        agent = self._agent(msg.rank)
        step = agent.steps.get(msg.step)
        slices = step.slices if step else []
        by_peer: dict[str, list[StepRequest]] = {}
        for rid, start, end in slices:
            req = agent.sends.get(rid)
            if req is None or req.state.terminal:
                continue
            req.state = Status.TRANSFERRING
            if end >= req.prompt_len and req.final_layers_left < 0:
                req.final_layers_left = len(agent.desc.placements)
                req.final_step = msg.step
            by_peer.setdefault(req.peer, []).append(
                StepRequest(
                    rid,
                    req.prompt_len,
                    start,
                    min(end, req.prompt_len),
                    req.blocks,
                    req.d_blocks,
                    req.mamba_mode,
                    req.num_spec,
                )
            )
        batches = []
        for endpoint, steps in by_peer.items():
            peer = self.peers[endpoint]
            batches.append((peer.te_session, peer.planners[msg.rank], steps))
        task = LayerTask(msg.step, msg.layer, CpuEvent(), batches)
        assert agent.stream is not None
        try:
            agent.stream.queue.put_nowait(task)
        except Exception:  # full: back-pressure the engine link without blocking the loop
            await asyncio.to_thread(agent.stream.put, task, self.settings.send_timeout_s)
        if step is not None:
            step.seen.add(msg.layer)
            # Engines signal layers in their own order (state layers only after the forward
            # pass), so the step ends when every layer was signalled, not at the last index.
            if ALL_LAYERS in step.seen or len(step.seen) >= len(agent.desc.placements):
                agent.steps.pop(msg.step, None)

    def _layer_done(self, agent: Agent, res: LayerResult) -> None:
        self.layer_latency.append(res.latency_s)
        del self.layer_latency[:-4096]
        for observe in getattr(self, "layer_latency_observers", ()):  # admin API histogram
            observe(res.latency_s)
        stats = agent.groups[res.group]
        stats.bytes += res.bytes
        stats.descriptors += res.descriptors
        if res.descriptors:
            stats.layers_sent += 1
        stats.transfers_ok += bool(res.ok)
        stats.transfers_failed += bool(res.failed)
        for rid, err in res.failed.items():
            req = agent.sends.get(rid)
            if req and req.finish(Status.FAILED, err):
                self._spawn(self._send_done(req))
        for rid in res.ok:
            req = agent.sends.get(rid)
            if req is None or req.state.terminal:
                continue
            req.bytes += res.req_bytes.get(rid, 0)
            prog = req.groups.setdefault(res.group, GroupProgress())
            prog.layers_sent += 1
            prog.bytes += res.req_bytes.get(rid, 0)
            # Only the final step's layers count: an earlier step's layers may still be on the
            # stream thread when the engine already signals the final step.
            if res.step == req.final_step and req.final_layers_left > 0:
                req.final_layers_left -= 1
                if req.final_layers_left == 0:
                    self._spawn(self._send_done(req))

    async def _send_done(self, req: SendRequest) -> None:
        """Tell every D rank this rank wrote to how the request ended, and wait for the acks."""
        status = Status.DONE if not req.state.terminal else req.state
        peer = self.peers.get(req.peer)
        if peer is None:
            req.finish(Status.FAILED, req.error or "no decode peer")
            return
        if not req.d_ranks:
            # This rank holds nothing any D rank needs (e.g. MLA comes from another P rank).
            req.finish(status, req.error)
            return
        errors = []
        for d_rank, groups in req.d_ranks.items():
            done = Done(
                request=req.id,
                sender_engine=self.settings.engine_id,
                sender_rank=req.rank,
                target_rank=d_rank,
                epoch=peer.epoch,
                status=status,
                groups=sorted(groups),
                bytes=req.bytes,
                error=req.error or None,
            )
            try:
                ack = await self._request_with_retries(peer, done)
            except DeadlineExceeded as e:
                errors.append(str(e))
                continue
            if not isinstance(ack, Ack) or not ack.ok:
                reason = ack.error if isinstance(ack, Ack) else getattr(ack, "reason", "")
                errors.append(f"decode rank {d_rank} refused Done: {reason}")
        if not errors and status is Status.DONE:
            for g in {g for groups in req.d_ranks.values() for g in groups}:
                self.agents[req.rank].groups[g].done += 1
        if errors:
            peer.failures += 1
            req.finish(
                Status.ABORTED if any("aborted" in e for e in errors) else Status.FAILED,
                "; ".join(errors),
            )
        else:
            req.finish(Status.DONE)

    # ---- receive side ----------------------------------------------------------------------

    def _expect(self, msg: ExpectRecv) -> Msg:
        agent = self._agent(msg.rank)
        if not self.admitting:
            return Reply(ok=False, error="sidecar is shutting down; not admitting requests")
        timeout = msg.timeout_s or self.settings.recv_timeout_s
        req = RecvRequest(
            id=msg.request,
            rank=msg.rank,
            prompt_len=msg.prompt_len,
            blocks=_blocks(msg.block_ids),
            deadline=time.monotonic() + timeout,
            peer=msg.prefill_engine,
            manifest=receive_manifest(agent.desc, msg.prefill_tp),
        )
        agent.recvs[req.id] = req
        try:
            check_block_ids(agent.desc, req.blocks, "decode")
        except OutOfBoundsError as e:
            req.finish(Status.FAILED, str(e))
            return Reply(ok=False, error=str(e))
        return Reply(data={"senders": len(req.manifest)})

    async def _on_peer(self, msg: AnyMsg, ident: bytes) -> Msg | None:
        if isinstance(msg, Hello):
            return self._hello(msg)
        if isinstance(msg, Done):
            return self._done(msg)
        if isinstance(msg, Abort):
            for agent in self.agents.values():
                await self._abort(agent.rank, msg.request, msg.reason, notify=False)
            return Ack(request=msg.request)
        return Error(reason=f"unexpected message {type(msg).__name__} on the control port")

    def _hello(self, msg: Hello) -> Msg:
        ok, why = self.ready
        if not ok:
            return Rejected(reason=f"decode sidecar not ready: {why}")
        if msg.compat_hash != self.compat_hash:
            return Rejected(
                reason=(
                    f"model mismatch: prefill compat hash {msg.compat_hash}, decode "
                    f"{self.compat_hash}; run the same preset, dtype and layer count on both"
                )
            )
        assert self.engine is not None
        return AgentMetadata(
            engine_id=self.settings.engine_id,
            epoch=self.epoch,
            tp_size=self.tp_size,
            te_session=self.engine.session_id,
            ranks=[rank_metadata(a.desc) for a in self.agents.values()],
        )

    def _done(self, msg: Done) -> Msg:
        if msg.epoch != self.epoch:
            return Ack(
                request=msg.request,
                ok=False,
                error=f"stale epoch {msg.epoch}; this sidecar runs {self.epoch}",
            )
        agent = self.agents.get(msg.target_rank)
        req = agent.recent_recv(msg.request) if agent else None
        if agent is None or req is None:
            return Ack(
                request=msg.request,
                ok=False,
                error=f"request {msg.request} is not expected on rank {msg.target_rank}",
            )
        if req.delivered.get(msg.sender_rank) is Status.DONE and msg.status is Status.DONE:
            # A retry after a lost ack: acknowledged again, counted once.
            self.counters["duplicate_dones"] += 1
            return Ack(request=msg.request)
        if req.state is Status.ABORTED:
            return Ack(request=msg.request, ok=False, error="aborted at decode")
        if req.state.terminal:
            return Ack(request=msg.request, ok=False, error=f"request already {req.state.name}")
        want = req.manifest.get(msg.sender_rank)
        if want is None:
            return Ack(
                request=msg.request,
                ok=False,
                error=f"prefill rank {msg.sender_rank} is not in the manifest",
            )
        req.bytes += msg.bytes
        if msg.status is not Status.DONE:
            req.finish(
                Status.FAILED,
                f"prefill rank {msg.sender_rank}: {msg.status.name} {msg.error or ''}".strip(),
            )
            return Ack(request=msg.request)
        if not want <= set(msg.groups):
            req.finish(
                Status.FAILED,
                f"prefill rank {msg.sender_rank} delivered groups "
                f"{sorted(msg.groups)}, expected {sorted(want)}",
            )
            return Ack(request=msg.request)
        req.delivered[msg.sender_rank] = Status.DONE
        req.state = Status.TRANSFERRING
        if set(req.delivered) >= set(req.manifest) and req.finish(Status.DONE):
            for g in {g for groups in req.manifest.values() for g in groups}:
                agent.groups[g].done += 1
        return Ack(request=msg.request)

    # ---- both ------------------------------------------------------------------------------

    async def _abort(self, rank: int, rid: str, reason: str, *, notify: bool) -> None:
        agent = self._agent(rank)
        req = agent.request(rid)
        if req is None or not req.finish(Status.ABORTED, reason):
            return
        peer = self.peers.get(req.peer) if isinstance(req, SendRequest) else None
        if notify and peer is not None:
            try:
                await peer.client.request(
                    Abort(request=rid, reason=reason), self.settings.ack_timeout_s
                )
            except DeadlineExceeded:
                peer.failures += 1

    async def _request_with_retries(self, peer: Peer, msg: Done, attempts: int = 3) -> Msg:
        """A lost frame must not turn a good transfer into an expiry: D acknowledges a repeated
        Done again without counting it twice."""
        for _ in range(attempts - 1):
            try:
                return await peer.client.request(msg, self.settings.ack_timeout_s)
            except DeadlineExceeded:
                log.warning("no ack for Done of %s from %s; retrying", msg.request, peer.endpoint)
        return await peer.client.request(msg, self.settings.ack_timeout_s)

    async def _tell_peers_aborted(self, told: set[tuple[str, str]], reason: str) -> None:
        """Send an ``Abort`` per (peer, request), all at once, each bounded by the ack timeout."""

        async def tell(peer: str, rid: str) -> None:
            entry = self.peers[peer]
            try:
                await entry.client.request(
                    Abort(request=rid, reason=reason), self.settings.ack_timeout_s
                )
            except KVSidecarError as e:
                entry.failures += 1
                log.warning("could not tell %s that %s was aborted: %s", peer, rid, e)

        if told:
            await asyncio.gather(*(tell(peer, rid) for peer, rid in sorted(told)))

    async def _watch(self) -> None:
        """Deadlines: every wait ends, in EXPIRED, even when the peer vanished."""
        while True:
            await asyncio.sleep(0.05)
            now = time.monotonic()
            for agent in self.agents.values():
                for req in agent.all_requests():
                    if not req.state.terminal and now > req.deadline:
                        side = "sending" if isinstance(req, SendRequest) else "waiting for prefill"
                        if req.finish(Status.EXPIRED, f"deadline passed while {side}"):
                            self.counters["expired"] += 1
                            if isinstance(req, SendRequest):
                                self._spawn(self._send_done(req))

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


def _threadsafe(loop: asyncio.AbstractEventLoop, fn: Callable[..., None], *args: Any) -> None:
    """Run ``fn`` on the loop from a stream thread."""
    loop.call_soon_threadsafe(fn, *args)


def _is_live(agent: Agent, rid: str) -> bool:
    req = agent.sends.get(rid)
    return req is not None and not req.state.terminal
