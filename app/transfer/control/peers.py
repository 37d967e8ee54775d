"""Remote sidecars as this one knows them: handshakes, heartbeats and leases.

A prefill sidecar meets a decode peer through a target (host, port, epoch) and handshakes with
it; a decode sidecar meets a prefill peer through that peer's ``Hello`` (its ``control``
endpoint), so that it can ask the prefill side to drain before freeing blocks. Both ping every
peer they share requests with. A peer that answers nothing for ``lease_s`` is declared lost: its
requests end on this side at once (not at their deadlines), and its later messages are answered
``Pong(known=False)`` so that, should it wake up, it stops too instead of writing late. A
prefill's ping names the requests it still sends to that decode (``Ping.sending``): decode's
receives of them wait on as long as prefill's sends live, however long the prefill.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field

from app.errors import DeadlineExceeded, KVSidecarError, LayoutMismatchError, ProtocolError
from app.kvcache.desc import LayoutDesc
from app.transfer.control.links import Connect, PeerLink
from app.transfer.planning.planner import PairPlanner
from app.transfer.wire.protocol import (
    AgentMetadata,
    Error,
    Hello,
    Ping,
    Pong,
    Rejected,
    tcp_endpoint,
)

log = logging.getLogger(__name__)

# Lost peers remembered (oldest forgotten first): far more than one deployment's engines.
_MAX_LOST = 4096

# Handshake -> planners for every local rank (raises LayoutMismatchError when they cannot pair).
MakePlanners = Callable[[dict[int, LayoutDesc]], dict[int, PairPlanner]]
OnLost = Callable[["Peer", str], Awaitable[None]]
Clock = Callable[[], float]


@dataclass(frozen=True)
class PeerSettings:
    """What the peer table reads of the sidecar's settings."""

    lease_s: float
    heartbeat_interval_s: float
    handshake_timeout_s: float


@dataclass
class Peer:
    """A remote sidecar, keyed by its control endpoint."""

    endpoint: str
    client: PeerLink
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
    # the table's clock at the last message or answer from it; the lease runs from here
    last_heard: float = 0.0
    in_use: bool = False
    # It checks a request's layers as they land (``LayerDigests``); an older decode does not.
    layer_digests: bool = True


class Peers:
    """The peer table of one sidecar."""

    def __init__(
        self,
        settings: PeerSettings,
        connect: Connect,
        *,
        hello: Callable[[str], Hello],
        make_planners: MakePlanners,
        on_lost: OnLost,
        on_handshake: Callable[[float], None],
        on_drop: Callable[[Peer], Awaitable[None]] | None = None,
        clock: Clock = time.monotonic,
    ) -> None:
        self.table: dict[str, Peer] = {}
        self.counters = {"handshakes": 0, "leases_lost": 0}
        # engine id -> (the epoch we declared lost, its control endpoint); its messages are
        # refused until it says Hello, and decode can still ask it whether it stopped writing
        self.lost: dict[str, tuple[str, str]] = {}
        self._settings, self._connect, self._clock = settings, connect, clock
        self._hello, self._make_planners = hello, make_planners
        self._on_lost, self._on_handshake = on_lost, on_handshake
        self._on_drop = on_drop

    # ---- lookup ----------------------------------------------------------------------------

    def by_engine(self, engine_id: str) -> Peer | None:
        return next((p for p in self.table.values() if p.engine_id == engine_id), None)

    def endpoint_of(self, engine_id: str) -> str | None:
        """Where ``engine_id``'s sidecar listens, even after we declared it lost."""
        peer = self.by_engine(engine_id)
        if peer is not None:
            return peer.endpoint
        lost = self.lost.get(engine_id)
        return lost[1] if lost else None

    def fresh(self, endpoint: str) -> bool:
        """Whether a write to this peer may start now: we heard from it within half a lease,
        so it cannot have declared us lost yet (it waits a whole lease)."""
        peer = self.table.get(endpoint)
        return peer is not None and self._clock() - peer.last_heard < self._settings.lease_s / 2

    def connect(self, endpoint: str) -> PeerLink:
        """A link of its own to ``endpoint`` (the caller closes it), whether or not the peer
        has an entry: a lost peer has none."""
        return self._connect(endpoint)

    def _entry(self, endpoint: str) -> Peer:
        peer = self.table.get(endpoint)
        if peer is None:
            link = self.connect(endpoint)
            peer = self.table[endpoint] = Peer(endpoint, link, last_heard=self._clock())
        return peer

    # ---- prefill side: targets and handshakes -----------------------------------------------

    async def target(
        self, host: str, port: int, epoch: str, engine_id: str = "", request: str = ""
    ) -> Peer:
        """The decode peer of a target, handshaken for the epoch the target names; raises
        when the sidecar there is another engine than the target's. ``request``: the transfer
        that needs it (a decode that refuses the handshake ends that load at once)."""
        endpoint = tcp_endpoint(host, port)
        peer = self._entry(endpoint)
        async with peer.lock:
            if not peer.planners or (epoch and epoch != peer.epoch):
                try:
                    await self._handshake(peer, request)
                except KVSidecarError:
                    # A peer that never answered keeps nothing here: no entry, no socket
                    # (measured: 100 dead targets had left 100 entries and their fds).
                    if not peer.planners:
                        await self.drop(peer)
                    raise
        if epoch and epoch != peer.epoch:
            raise LayoutMismatchError(
                f"decode sidecar {endpoint} restarted: the request targets epoch {epoch}, the "
                f"sidecar now runs epoch {peer.epoch}; re-admit the request at decode"
            )
        if engine_id and engine_id != peer.engine_id:
            raise LayoutMismatchError(
                f"target names decode engine {engine_id}, but the sidecar at {endpoint} serves "
                f"engine {peer.engine_id}"
            )
        return peer

    async def _handshake(self, peer: Peer, request: str = "") -> None:
        t0 = self._clock()
        hello = self._hello(request)
        try:
            reply = await peer.client.request(hello, self._settings.handshake_timeout_s)
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
        descs = {m.rank: m for m in reply.ranks}
        try:
            planners = self._make_planners(descs)
        except LayoutMismatchError as e:
            peer.failures += 1
            peer.last_error = str(e)
            raise
        peer.epoch, peer.engine_id, peer.te_session = reply.epoch, reply.engine_id, reply.te_session
        peer.descs, peer.planners = descs, planners
        peer.handshakes += 1
        peer.last_handshake = time.time()
        peer.last_heard = self._clock()
        self.counters["handshakes"] += 1
        self._on_handshake(self._clock() - t0)

    # ---- decode side: who may write to us --------------------------------------------------

    def met(self, msg: Hello) -> Peer | None:
        """A prefill peer said Hello: remember where to reach it and forgive an old loss."""
        self.lost.pop(msg.engine_id, None)
        if not msg.control:
            return None
        old = self.by_engine(msg.engine_id)
        if old is not None and old.endpoint != msg.control:
            old.engine_id = ""  # the engine moved; the old entry is reaped when idle
        peer = self._entry(msg.control)
        peer.engine_id, peer.epoch = msg.engine_id, msg.epoch
        peer.last_heard = self._clock()
        return peer

    def answered(self, peer: Peer) -> None:
        """``peer`` answered a request of ours: its lease runs from now."""
        peer.last_heard = self._clock()

    def heard(self, engine_id: str, epoch: str) -> bool:
        """A message came from ``engine_id``; False if we declared that peer lost."""
        lost = self.lost.get(engine_id)
        if lost is not None and lost[0] == epoch:
            return False
        peer = self.by_engine(engine_id)
        if peer is not None and (not peer.epoch or peer.epoch == epoch):
            peer.last_heard = self._clock()
        return True

    # ---- heartbeats and leases -------------------------------------------------------------

    async def heartbeat(
        self,
        in_use: Iterable[str],
        engine_id: str,
        epoch: str,
        sending: Callable[[str], list[str]] = lambda _endpoint: [],
    ) -> None:
        """One round: ping the peers in use, declare lost those silent past the lease, and
        drop idle peers that stopped answering. ``sending(endpoint)``: the requests this
        sidecar still sends to that peer, named in its ping."""
        wanted = set(in_use)
        now = self._clock()
        for peer in list(self.table.values()):
            if peer.endpoint in wanted and not peer.in_use:
                peer.last_heard = max(peer.last_heard, now)  # the lease starts with the use
            peer.in_use = peer.endpoint in wanted
        peers = list(self.table.values())
        pings = [Ping(engine_id=engine_id, epoch=epoch, sending=sending(p.endpoint)) for p in peers]
        await asyncio.gather(*(self._ping(p, ping) for p, ping in zip(peers, pings, strict=True)))

    async def _ping(self, peer: Peer, ping: Ping) -> None:
        s = self._settings
        try:
            reply = await peer.client.request(ping, s.heartbeat_interval_s)
        except KVSidecarError:
            reply = None
        if isinstance(reply, Pong):
            if not reply.known:
                await self.lose(peer, f"peer {peer.endpoint} had declared this sidecar lost")
                return
            if peer.epoch and reply.epoch != peer.epoch:
                await self.lose(
                    peer, f"peer {peer.endpoint} restarted (epoch {peer.epoch} -> {reply.epoch})"
                )
                return
            peer.last_heard = self._clock()
            return
        silent = self._clock() - peer.last_heard
        if silent <= s.lease_s:
            return
        if peer.in_use:
            self.counters["leases_lost"] += 1
            await self.lose(
                peer, f"peer {peer.endpoint} silent for {silent:.1f} s (lease {s.lease_s:g} s)"
            )
        else:
            await self.drop(peer)  # idle and gone: reaped

    async def lose(self, peer: Peer, reason: str) -> None:
        """End everything shared with ``peer`` and forget it (the next use handshakes anew)."""
        log.warning("%s; ending its requests", reason)
        peer.last_error = reason
        if peer.engine_id and peer.epoch:
            self.lost[peer.engine_id] = (peer.epoch, peer.endpoint)
            while len(self.lost) > _MAX_LOST:
                del self.lost[next(iter(self.lost))]
        await self.drop(peer)
        await self._on_lost(peer, reason)

    async def drop(self, peer: Peer) -> None:
        if self.table.get(peer.endpoint) is peer:
            del self.table[peer.endpoint]
        await peer.client.close()
        if self._on_drop is not None:
            await self._on_drop(peer)

    async def close(self) -> None:
        for peer in list(self.table.values()):
            await peer.client.close()
        self.table.clear()
