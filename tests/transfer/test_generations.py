"""A rank that registers again within its epoch is a new engine process: a new generation (a
new epoch) begins, every request of the old one fails, its memory is unregistered, and every
peer is told (``NewEpoch``) and forgotten, so that the next request handshakes anew. A
registration that is refused starts nothing."""

from __future__ import annotations

import os
import secrets
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

import msgspec
import numpy as np
import pytest

from app.devices.shm import SHM_DIR
from app.errors import ConfigError
from app.kvcache.desc import LayoutDesc
from app.kvcache.engine_spec import Axis, EngineGroup, EngineLayer, EngineRegistration, MemorySpan
from app.transfer.control.peers import Peer, Peers
from app.transfer.requests.agent import Agent, RecvRequest, SendRequest
from app.transfer.requests.registry import Registry, RegistrySettings
from app.transfer.requests.stream import StreamThread
from app.transfer.wire.protocol import Ack, Hello, NewEpoch, Role, Status
from tests.conftest import Clock
from tests.transfer.conftest import D_ENDPOINT, Net, make_peers

BLOCKS, HEADS, KB, CH = 8, 2, 16, 128
PAGE = HEADS * KB * CH * 2  # bytes of one block of one layer (bf16)


def registration(shm: str, model: str = "tiny") -> EngineRegistration:
    names = ["model.layers.0.attn", "model.layers.1.attn"]
    layers = [
        EngineLayer(
            name=name,
            group=0,
            buffer=0,
            offset=i * BLOCKS * PAGE,
            dtype="bfloat16",
            axes=[
                Axis("block", BLOCKS, PAGE // 2),
                Axis("head", HEADS, KB * CH),
                Axis("token", KB, CH),
                Axis("channel", CH, 1),
            ],
            head_size=CH // 2,
            head_size_v=CH // 2,
            total_heads=HEADS,
        )
        for i, name in enumerate(names)
    ]
    return EngineRegistration(
        engine_id="decode-a",
        rank=0,
        tp_size=1,
        model=model,
        engine_version="0.32.0",
        num_blocks=BLOCKS,
        groups=[EngineGroup("full", KB, KB, list(names))],
        layers=layers,
        memory=[MemorySpan(shm, 0, 2 * BLOCKS * PAGE)],
    )


@dataclass
class FakeEngine:
    """The Mooncake engine as the registry uses it: what is registered for remote writes."""

    spans: list[tuple[int, int]] = field(default_factory=list)
    unregistered: int = 0

    def register_many(self, spans: list[tuple[int, int]]) -> None:
        self.spans.extend(spans)

    def unregister_all(self) -> None:
        self.spans.clear()
        self.unregistered += 1


@pytest.fixture
def shm() -> Iterator[str]:
    name = f"kvsc-test-gen-{secrets.token_hex(4)}"
    path = os.path.join(SHM_DIR, name)
    with open(path, "wb") as f:
        f.truncate(2 * BLOCKS * PAGE)
    yield name
    os.unlink(path)


@dataclass
class World:
    registry: Registry
    engine: FakeEngine
    net: Net
    peers: Peers
    drained: list[str]
    streams: list[StreamThread]


@pytest.fixture
async def world(layout: LayoutDesc) -> AsyncIterator[World]:
    net: Net = Net()
    streams: list[StreamThread] = []
    drained: list[str] = []
    peers = make_peers(net, Clock(), layout)

    def stream_for(agent: Agent) -> StreamThread:
        s = StreamThread(
            f"test-{agent.rank}",
            4,
            lambda *a: None,
            lambda r: None,
            lambda e, ids: [],
            lambda ids: None,
        )
        streams.append(s)
        return s

    async def drain(req: SendRequest) -> bool:
        drained.append(req.id)
        return True

    registry = Registry(
        RegistrySettings(
            engine_id="decode-a", ranks=(0,), tp_size=1, device_type="auto", lease_s=1.0
        ),
        {},
        peers,
        stream_for=stream_for,
        drained=drain,
        control_port=lambda: 5200,
    )
    engine = FakeEngine()
    registry.engine = engine  # type: ignore[assignment]
    yield World(registry, engine, net, peers, drained, streams)
    for s in streams:
        s.stop(1.0)


def blocks() -> tuple[np.ndarray, ...]:
    return (np.asarray([1, 2], np.int64),)


async def test_registering_again_starts_a_new_generation(world: World, shm: str) -> None:
    r = world.registry
    assert (await r.register_engine(registration(shm))).ok
    first = r.epoch
    agent = r.agents[0]
    recv = RecvRequest("in", 0, 10, blocks(), 1e9, "prefill-a")
    send = SendRequest("out", 0, 10, blocks(), 1e9, D_ENDPOINT)
    agent.recvs[recv.id], agent.sends[send.id] = recv, send
    peer = await _peer(world)

    assert (await r.register_engine(registration(shm))).ok
    assert r.generation == 1 and r.epoch != first
    assert recv.state is Status.FAILED and send.state is Status.FAILED
    assert world.drained == ["out"]  # its writes left the wire before the memory went
    assert world.engine.unregistered == 1
    [note] = world.net.sent(NewEpoch, D_ENDPOINT)
    assert (note.old, note.new) == (first, r.epoch)
    assert world.peers.table == {} and peer.client.closed  # type: ignore[attr-defined]
    assert r.agents[0] is not agent and r.agents[0].epoch == r.epoch
    assert {q.id for q in r.agents[0].history} == {"in", "out"}  # retired unreported


async def test_refused_registration_starts_no_generation(world: World, shm: str) -> None:
    r = world.registry
    assert (await r.register_engine(registration(shm))).ok
    first = r.epoch
    await _peer(world)
    with pytest.raises(ConfigError, match="hosts ranks"):
        await r.register_engine(msgspec.structs.replace(registration(shm), rank=3))
    with pytest.raises(ConfigError, match="does not exist"):
        await r.register_engine(registration("kvsc-test-gen-missing"))
    assert (r.generation, r.epoch) == (0, first)
    assert world.net.sent(NewEpoch) == [] and D_ENDPOINT in world.peers.table


async def _peer(world: World) -> Peer:
    """A peer that met us and answers NewEpoch once it drained."""
    world.net.answers[D_ENDPOINT] = lambda m: Ack(request="")
    hello = Hello(
        compat_hash="", engine_id="prefill-a", role=Role.PREFILL, epoch="p1", control=D_ENDPOINT
    )
    peer = world.peers.met(hello)
    assert peer is not None
    return peer
