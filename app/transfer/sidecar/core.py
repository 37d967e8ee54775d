"""The parts of a sidecar and how they are wired: the agents of its ranks, the peer table, the
send and receive sides, the registry and the target signer, each handed the callbacks of the
others; and what the sidecar offers the admin API and the engine link alike (its views, aborts,
targets). ``process.Sidecar`` adds the lifecycle, the two ports' dispatch and the background
loops.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine
from functools import partial
from typing import Any, Literal

import zmq.asyncio

from app.config import SidecarSettings
from app.errors import ProtocolError
from app.kvcache.desc import LayoutDesc
from app.kvcache.digest import DigestShare
from app.store.service import PoolService
from app.transfer.control.links import zmq_links
from app.transfer.control.peers import Peer, Peers, PeerSettings
from app.transfer.control.server import ControlServer
from app.transfer.lanes.mooncake import MooncakeEngine
from app.transfer.planning.planner import PairPlanner
from app.transfer.requests.agent import Agent, agent_of
from app.transfer.requests.receiving import RecvSettings, RecvSide
from app.transfer.requests.registry import Registry, RegistrySettings
from app.transfer.requests.send_ending import SendSettings
from app.transfer.requests.sending import SendSide
from app.transfer.requests.stream import StreamThread
from app.transfer.requests.traces import TransferTraces
from app.transfer.wire.auth import load_auth
from app.transfer.wire.protocol import Hello, RemoteTarget, Role, SetTarget
from app.transfer.wire.target_auth import TargetSigner

Observer = Callable[[float], None]
ObserverKind = Literal["layer", "handshake"]


class SidecarCore:
    """The parts of a sidecar hosting the agents of the ranks in its pod, wired together."""

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
        # Set by whatever may bring a deadline sooner than the watcher's next wake: an engine
        # message (the only way requests are admitted) and a claim (it starts the writes'
        # bound). The deadline watcher sleeps on it, so neither an idle sidecar nor one whose
        # requests wait quietly polls.
        self._deadlines_moved = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self._auth = load_auth(settings)
        self._targets = TargetSigner.of(self._auth)
        # kv_digest.share, changed at run time by the admin API (PUT /v1/kv_digest).
        self.digest = DigestShare(settings.kv_digest.share)
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
                transfer_max_s=settings.transfer_max_s,
                max_held_sends=settings.max_held_sends,
                max_held_blocks=settings.max_held_blocks,
                digest=self.digest,
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
                recv_queue_timeout_s=settings.recv_queue_timeout_s,
                quarantine_max_s=settings.quarantine_max_s,
                heartbeat_interval_s=settings.heartbeat_interval_s,
                transfer_max_s=settings.transfer_max_s,
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
            **self.send.counters,
            "generations": self.registry.generation,
            "unconfirmed_sends": self.send.unconfirmed,
        }

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

    # ---- operations ------------------------------------------------------------------------

    def _live_requests(self) -> bool:
        return self._next_deadline() is not None

    def _next_deadline(self) -> float | None:
        """The earliest deadline of a request in flight; None when none is."""
        return min(
            (
                r.deadline
                for a in self.agents.values()
                for r in a.all_requests()
                if not r.state.terminal
            ),
            default=None,
        )

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
        raises AuthError for a target decode's sidecar did not sign or signed for another
        transfer or another prompt (the send keeps waiting for the real one), ProtocolError when
        the target does not fit the send."""
        holding = [rank for rank, agent in sorted(self.agents.items()) if rid in agent.sends]
        # All checked before any takes it: a bad target is nobody's. Each rank's send checks the
        # signature and that the target is bound to its transfer id and its prompt.
        for rank in holding:
            self.send.check_target(rank, rid, remote)
        out: dict[int, str | None] = {}
        for rank in holding:
            reply = self.send.set_target(SetTarget(rank=rank, request=rid, remote=remote))
            out[rank] = None if reply.ok else reply.error
        return out

    # ---- its parts' callbacks --------------------------------------------------------------

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

    def _planners(self, descs: dict[int, LayoutDesc]) -> dict[int, PairPlanner]:
        return {rank: PairPlanner(agent.desc, descs) for rank, agent in self.agents.items()}

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

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _call_soon(self, fn: Callable[..., None], *args: Any) -> None:
        """Run ``fn`` on the loop, from any thread."""
        assert self._loop is not None
        self._loop.call_soon_threadsafe(fn, *args)
