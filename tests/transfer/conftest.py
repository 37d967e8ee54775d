"""Shared fixtures of the transfer tests.

Besides the ZMQ context of the socket tests, the request state machines (``SendSide``,
``RecvSide``, ``Peers``, ``Registry``) are built here without processes: a settable clock, and
a fake network whose peers are functions of the message they are asked. These are unit tests of
the rules; tests/e2e and tests/chaos run the same behaviours against real processes.
"""

from __future__ import annotations

import asyncio
import inspect
import queue
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

import pytest
import zmq.asyncio

from app.errors import DeadlineExceeded, KVSidecarError
from app.kvcache.desc import LayoutDesc
from app.kvcache.groups import build_cache_config
from app.kvcache.layout import allocate
from app.kvcache.preset_registration import describe
from app.kvcache.presets import load_preset
from app.transfer.control.links import PeerLink
from app.transfer.control.peers import Peer, Peers, PeerSettings
from app.transfer.planning.planner import PairPlanner
from app.transfer.requests.agent import Agent, RecvRequest, SendRequest
from app.transfer.requests.receiving import RecvSettings, RecvSide
from app.transfer.requests.send_ending import SendSettings
from app.transfer.requests.sending import SendSide
from app.transfer.requests.stream import LayerTask
from app.transfer.wire.protocol import (
    Abort,
    Ack,
    AddSend,
    AgentMetadata,
    AnyMsg,
    BeginStep,
    Claim,
    Done,
    ExpectRecv,
    Hello,
    LayerReady,
    Msg,
    Ping,
    Pong,
    RemoteTarget,
    Role,
    Status,
    StepSlice,
)
from app.transfer.wire.target_auth import TargetSigner, prompt_digest
from tests.conftest import Clock


@pytest.fixture
async def ctx() -> AsyncIterator[zmq.asyncio.Context]:
    """An asyncio ZMQ context for the test's servers and clients, destroyed after it."""
    c = zmq.asyncio.Context()
    yield c
    c.destroy(linger=0)


# ---- the state machines without processes --------------------------------------------------

P_ENGINE, D_ENGINE = "prefill-a", "decode-a"
P_ENDPOINT, D_ENDPOINT = "tcp://prefill.test:5100", "tcp://decode.test:5200"
P_EPOCH, D_EPOCH = "p-epoch-1", "d-epoch-1"
NUM_BLOCKS = 16
LEASE_S = 10.0
# Real seconds: how often a quarantine looks again (the fake clock decides what is overdue).
TICK_S = 0.005

M = TypeVar("M", bound=Msg)


# What a fake peer answers: a reply, None for silence (the request times out), or an awaitable
# of either (to answer later, when the test says so).
Reply = AnyMsg | None
Answer = Callable[[Msg], Reply | Awaitable[Reply]]


class FakeLink:
    """A ``PeerLink`` to a fake peer of a :class:`Net`."""

    def __init__(self, net: Net, endpoint: str) -> None:
        self.net, self.endpoint = net, endpoint
        self.closed = False

    async def request(self, msg: Msg, timeout: float) -> AnyMsg:
        if self.closed:
            raise KVSidecarError(f"link to {self.endpoint} is closed")
        self.net.asked.append((self.endpoint, msg))
        answer = self.net.answers.get(self.endpoint)
        reply = answer(msg) if answer is not None else None
        if inspect.isawaitable(reply):
            reply = await reply
        if reply is None:
            raise DeadlineExceeded(f"no reply from {self.endpoint} to {type(msg).__name__}")
        return reply

    async def gone(self) -> bool:
        return self.endpoint in self.net.gone

    async def close(self) -> None:
        self.closed = True


@dataclass
class Net:
    """Every link the side under test opened, what it asked, and how each peer answers."""

    answers: dict[str, Answer] = field(default_factory=dict)
    gone: set[str] = field(default_factory=set)  # sidecars whose port refuses connections
    asked: list[tuple[str, Msg]] = field(default_factory=list)
    links: list[FakeLink] = field(default_factory=list)

    def connect(self, endpoint: str) -> PeerLink:
        link = FakeLink(self, endpoint)
        self.links.append(link)
        return link

    def sent(self, kind: type[M], endpoint: str | None = None) -> list[M]:
        return [
            m for e, m in self.asked if isinstance(m, kind) and (endpoint is None or e == endpoint)
        ]


class Tasks:
    """The ``spawn`` hook: runs coroutines on the loop and lets the test wait for them."""

    def __init__(self) -> None:
        self.running: set[asyncio.Task[None]] = set()

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self.running.add(task)
        task.add_done_callback(self.running.discard)

    async def settle(self, timeout: float = 2.0) -> None:
        """Wait until every spawned task (and what they spawn, and callbacks scheduled on the
        loop) ended."""
        async with asyncio.timeout(timeout):
            while True:
                for _ in range(3):
                    await asyncio.sleep(0)
                if not self.running:
                    return
                await asyncio.gather(*self.running, return_exceptions=True)

    async def cancel(self) -> None:
        for task in list(self.running):
            task.cancel()
        await asyncio.gather(*self.running, return_exceptions=True)


def call_soon(fn: Callable[..., None], *args: Any) -> None:
    """The ``call_soon`` hook; tests call the stream-thread hooks from the loop itself."""
    asyncio.get_running_loop().call_soon(fn, *args)


async def until(what: str, cond: Callable[[], bool], timeout: float = 2.0) -> None:
    """Yield to the loop until ``cond()`` holds; fail after ``timeout`` real seconds."""
    try:
        async with asyncio.timeout(timeout):
            while not cond():
                await asyncio.sleep(TICK_S / 5)
    except TimeoutError:
        pytest.fail(f"timed out waiting for {what}")


def _desc(engine_rank: int = 0) -> LayoutDesc:
    model = load_preset("llama-3.1-8b", layers=2)
    return describe(allocate(build_cache_config(model, 1, 16, num_blocks=NUM_BLOCKS), engine_rank))


@pytest.fixture(scope="session")
def layout() -> LayoutDesc:
    """One rank (TP 1) of a two-layer model with one full-attention group."""
    return _desc()


def ids(*per_group: list[int]) -> list[list[int]]:
    return [list(g) for g in per_group]


MINE = ids([1, 2, 3])  # the request's own decode blocks
OTHER = ids([4, 5, 6])  # another request's


def peer_settings() -> PeerSettings:
    return PeerSettings(lease_s=LEASE_S, heartbeat_interval_s=1.0, handshake_timeout_s=1.0)


@dataclass
class Lost:
    """The ``on_lost`` hook: which peers the table declared lost, and why."""

    calls: list[tuple[str, str]] = field(default_factory=list)

    async def __call__(self, peer: Peer, reason: str) -> None:
        self.calls.append((peer.endpoint, reason))


def make_peers(net: Net, clock: Clock, layout: LayoutDesc, lost: Lost | None = None) -> Peers:
    def hello(request: str = "") -> Hello:
        return Hello(
            compat_hash=layout.compat_hash, engine_id=P_ENGINE, role=Role.PREFILL, request=request
        )

    def planners(descs: dict[int, LayoutDesc]) -> dict[int, PairPlanner]:
        return {layout.rank: PairPlanner(layout, descs)}

    return Peers(
        peer_settings(),
        net.connect,
        hello=hello,
        make_planners=planners,
        on_lost=lost if lost is not None else Lost(),
        on_handshake=lambda _s: None,
        clock=clock,
    )


# ---- decode ----------------------------------------------------------------------------------


@dataclass
class Decode:
    """A decode sidecar's receive side, with prefill ``P_ENGINE`` (at ``P_ENDPOINT``) met."""

    side: RecvSide
    peers: Peers
    agent: Agent
    net: Net
    clock: Clock
    tasks: Tasks
    epoch: list[str]
    lost: Lost

    def expect(
        self,
        rid: str = "r1",
        block_ids: list[list[int]] = MINE,
        prefill: str = "",
        timeout_s: float | None = None,
        queue_timeout_s: float | None = None,
    ) -> Msg:
        return self.side.expect(
            ExpectRecv(
                rank=0,
                request=rid,
                prompt_len=40,
                block_ids=block_ids,
                prefill_tp=1,
                prefill_engine=prefill,
                timeout_s=timeout_s,
                queue_timeout_s=queue_timeout_s,
            )
        )

    def req(self, rid: str = "r1") -> RecvRequest:
        req = self.agent.recent(rid, RecvRequest)
        assert req is not None
        return req

    def claim(
        self,
        rid: str = "r1",
        engine: str = P_ENGINE,
        rank: int = 0,
        block_ids: list[list[int]] = MINE,
        epoch: str = D_EPOCH,
    ) -> Ack:
        return self.side.claim(
            Claim(
                request=rid,
                sender_engine=engine,
                sender_rank=rank,
                target_rank=0,
                epoch=epoch,
                block_ids=block_ids,
            )
        )

    def done(
        self,
        rid: str = "r1",
        engine: str = P_ENGINE,
        rank: int = 0,
        status: Status = Status.DONE,
        groups: list[int] | None = None,
        epoch: str = D_EPOCH,
    ) -> Ack:
        return self.side.done(
            Done(
                request=rid,
                sender_engine=engine,
                sender_rank=rank,
                target_rank=0,
                epoch=epoch,
                status=status,
                groups=[g.index for g in self.agent.desc.groups] if groups is None else groups,
                bytes=100,
            )
        )

    def finished(self) -> tuple[list[str], list[str]]:
        """What the engine hears now: (received ids, failed ids)."""
        _, recving, failed = self.agent.finished()
        return recving, [f.request for f in failed]


def recv_settings(quarantine_max_s: float = 30.0) -> RecvSettings:
    return RecvSettings(
        engine_id=D_ENGINE,
        recv_timeout_s=60.0,
        recv_queue_timeout_s=None,
        quarantine_max_s=quarantine_max_s,
        heartbeat_interval_s=TICK_S,
    )


@pytest.fixture
async def decode(layout: LayoutDesc) -> AsyncIterator[Decode]:
    net, clock, tasks, epoch, lost = Net(), Clock(), Tasks(), [D_EPOCH], Lost()
    peers = make_peers(net, clock, layout, lost)
    agents = {0: Agent(None, layout, D_ENGINE)}
    side = RecvSide(
        recv_settings(),
        agents,
        peers,
        spawn=tasks.spawn,
        epoch=lambda: epoch[0],
        clock=clock,
    )
    peers.met(
        Hello(
            compat_hash="", engine_id=P_ENGINE, role=Role.PREFILL, epoch=P_EPOCH, control=P_ENDPOINT
        )
    )
    yield Decode(side, peers, agents[0], net, clock, tasks, epoch, lost)
    await tasks.cancel()


# ---- prefill ---------------------------------------------------------------------------------


@dataclass
class DecodeStub:
    """How the fake decode sidecar at ``D_ENDPOINT`` answers; tests change the fields."""

    layout: LayoutDesc
    epoch: str = D_EPOCH
    claim: Callable[[Claim], Reply] = lambda m: Ack(request=m.request)
    done: Callable[[Done], Reply | Awaitable[Reply]] = lambda m: Ack(request=m.request)
    abort: Callable[[Abort], Reply] = lambda m: Ack(request=m.request)
    ping: Callable[[Ping], Reply] | None = None

    def __call__(self, msg: Msg) -> Reply | Awaitable[Reply]:
        if isinstance(msg, Hello):
            return AgentMetadata(
                engine_id=D_ENGINE,
                epoch=self.epoch,
                tp_size=1,
                te_session="decode.test:7000",
                ranks=[self.layout],
            )
        if isinstance(msg, Claim):
            return self.claim(msg)
        if isinstance(msg, Done):
            return self.done(msg)
        if isinstance(msg, Abort):
            return self.abort(msg)
        if isinstance(msg, Ping):
            return self.ping(msg) if self.ping else Pong(epoch=self.epoch)
        return None


# The key the fake decode signs targets with, and the send side checks them with.
SIGNER = TargetSigner(b"t" * 32)
# The prompt the sends here run (40 tokens), and the fake decode's targets are signed for.
PROMPT_DIGEST = prompt_digest(range(40))


def target(
    rid: str = "r1",
    d_ids: list[list[int]] = MINE,
    epoch: str = D_EPOCH,
    computed: int = 0,
    digest: str = PROMPT_DIGEST,
) -> RemoteTarget:
    """The fake decode's target for ``rid`` and the prompt whose digest is ``digest``."""
    host, port = D_ENDPOINT.removeprefix("tcp://").rsplit(":", 1)
    return SIGNER.sign(
        RemoteTarget(
            request_id=rid,
            host=host,
            port=int(port),
            engine_id=D_ENGINE,
            epoch=epoch,
            tp_size=1,
            block_ids=d_ids,
            computed=computed,
            prompt_digest=digest,
        )
    )


@dataclass
class Prefill:
    """A prefill sidecar's send side writing to the fake decode ``D_ENDPOINT``."""

    side: SendSide
    peers: Peers
    agent: Agent
    net: Net
    clock: Clock
    tasks: Tasks
    stub: DecodeStub
    lost: Lost

    async def add(
        self,
        rid: str = "r1",
        d_ids: list[list[int]] = MINE,
        epoch: str = D_EPOCH,
        *,
        waiting: bool = False,
    ) -> Msg:
        """Admit ``rid`` with its target, or ``waiting`` for one (concurrent dispatch)."""
        return await self.side.add(
            AddSend(
                rank=0,
                request=rid,
                prompt_len=40,
                block_ids=ids([7, 8, 9]),
                remote=None if waiting else target(rid, d_ids, epoch),
                prompt_digest=PROMPT_DIGEST,
            )
        )

    def req(self, rid: str = "r1") -> SendRequest:
        req = self.agent.recent(rid, SendRequest)
        assert req is not None
        return req

    def pin(self, *rids: str) -> list[str]:
        return self.side.pin(self.agent, D_ENDPOINT, list(rids))


def send_settings(send_timeout_s: float = 30.0) -> SendSettings:
    return SendSettings(engine_id=P_ENGINE, send_timeout_s=send_timeout_s, ack_timeout_s=1.0)


def make_prefill(
    layout: LayoutDesc, send_timeout_s: float = 30.0, settings: SendSettings | None = None
) -> Prefill:
    net, clock, tasks, lost = Net(), Clock(), Tasks(), Lost()
    stub = DecodeStub(layout)
    net.answers[D_ENDPOINT] = stub
    peers = make_peers(net, clock, layout, lost)
    agents = {0: Agent(None, layout, P_ENGINE)}
    side = SendSide(
        settings or send_settings(send_timeout_s),
        agents,
        peers,
        spawn=tasks.spawn,
        call_soon=call_soon,
        on_layer_latency=lambda _s: None,
        verify_target=SIGNER.verify,
        clock=clock,
    )
    return Prefill(side, peers, agents[0], net, clock, tasks, stub, lost)


@pytest.fixture
async def prefill(layout: LayoutDesc) -> AsyncIterator[Prefill]:
    p = make_prefill(layout)
    yield p
    await p.tasks.cancel()


class Stream:
    """The stream thread's queue, read by the test instead of a thread."""

    def __init__(self) -> None:
        self.queue: queue.Queue[LayerTask | None] = queue.Queue()

    def put(self, task: LayerTask, timeout: float) -> None:
        self.queue.put(task, timeout=timeout)

    def tasks(self) -> list[LayerTask]:
        out = []
        while not self.queue.empty():
            task = self.queue.get_nowait()
            assert task is not None
            out.append(task)
        return out


@pytest.fixture
def stream(prefill: Prefill) -> Stream:
    s = Stream()
    prefill.agent.stream = s  # type: ignore[assignment]
    return s


async def step(prefill: Prefill, n: int, start: int, end: int, rid: str = "r1") -> None:
    """Engine step ``n`` computed ``[start, end)`` of ``rid`` and signalled both layers."""
    prefill.side.begin_step(BeginStep(rank=0, step=n, slices=[StepSlice(rid, start, end)]))
    for layer in (0, 1):
        await prefill.side.layer_ready(LayerReady(rank=0, step=n, layer=layer))


def planned(task: LayerTask) -> list[tuple[str, int, int]]:
    return [(s.request_id, s.start, s.end) for b in task.batches for s in b.steps]
