"""Out-of-bounds numbers are refused at decode, with a ProtocolError naming the field."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import pytest
import torch
import zmq
import zmq.asyncio

from app.errors import ProtocolError
from app.kvcache.desc import GroupDesc, LayoutDesc
from app.kvcache.engine_spec import (
    Axis,
    EngineGroup,
    EngineLayer,
    EngineRegistration,
    MemorySpan,
    StatePart,
    StateTensor,
)
from app.kvcache.groups import build_cache_config
from app.kvcache.layout import LayerPlacement, LayoutMode, Piece, Region, Stream, allocate
from app.kvcache.preset_registration import preset_registration
from app.kvcache.presets import load_preset
from app.kvcache.specs import RegionKind, SpecKind
from app.transfer.control.server import ControlServer
from app.transfer.planning.planner import MambaMode
from app.transfer.wire.codec import decode, encode
from app.transfer.wire.protocol import (
    MAX_DEADLINE_S,
    MAX_TP,
    AddSend,
    AgentMetadata,
    AnyMsg,
    BeginStep,
    Done,
    Error,
    ExpectRecv,
    Hello,
    LayerReady,
    Msg,
    PoolLoaded,
    PoolSave,
    RegisterEngine,
    RemoteTarget,
    Role,
    Status,
    StepSlice,
)
from app.transfer.wire.target_auth import remote_target

pytestmark = pytest.mark.timeout(30)

EXPECT = ExpectRecv(
    rank=0, request="r", prompt_len=64, block_ids=[[1, 2]], prefill_tp=2, timeout_s=5.0
)
TARGET = RemoteTarget("r", "127.0.0.1", 5600, "d", "ep", 1, [[3, 4]])
ADD = AddSend(rank=0, request="r", prompt_len=64, block_ids=[[1, 2]], remote=TARGET)
DONE = Done(
    request="r",
    sender_engine="p",
    sender_rank=0,
    target_rank=0,
    epoch="ep",
    status=Status.DONE,
    groups=[0],
)
GROUP = GroupDesc(0, SpecKind.FULL, 16, 16, (0, 1))
PIECE = Piece("k", 0, 1, 0, 8, 0, 8, 512, 512)
PLACEMENT = LayerPlacement(0, 0, 4096, 8192, 8192, 1, (PIECE,), 0)
REGION = Region(4096, 65536, 8192, RegionKind.SPLIT, 0, (0, 1), (Stream(0, 4096),))
RANK = LayoutDesc("c", 1, 0, 8, 0, "HND", "per_layer", (GROUP,), (PLACEMENT,), (REGION,))
META = AgentMetadata(engine_id="d", epoch="ep", tp_size=1, te_session="h:1", ranks=[RANK])
# What the simulated engine sends: a preset rank (heads-major, so with a kernel axis).
SIM = RegisterEngine(
    registration=preset_registration(
        allocate(
            build_cache_config(load_preset("llama-3.1-8b", layers=2), 1, 32, num_blocks=8),
            0,
            mode=LayoutMode.CROSS_LAYER,
            heads_major=True,
            allocator=lambda n: torch.empty(n, dtype=torch.uint8),
        ),
        engine_id="e",
    )
)
ENGINE = RegisterEngine(
    registration=EngineRegistration(
        engine_id="e",
        rank=0,
        tp_size=2,
        model="m",
        engine_version="0.33.0",
        num_blocks=8,
        groups=[
            EngineGroup("sliding", 16, 16, ["l0"], sliding_window=128),
            EngineGroup("mamba", 16, 16, ["l1"], mamba_mode="align", num_spec=1),
        ],
        layers=[
            EngineLayer(
                "l0", 0, 0, 0, "bfloat16", [Axis("block", 8, 4096), Axis("token", 16, 256)], 128
            ),
            EngineLayer(
                "l1",
                1,
                0,
                65536,
                "bfloat16",
                block_stride=1024,
                states=[
                    StateTensor("conv", "bfloat16", 0, [3, 64], True, False, [StatePart("x", 8, 8)])
                ],
            ),
        ],
        memory=[MemorySpan("kv", 0, 1 << 20)],
    )
)
SAVE = PoolSave(rank=0, request="r", token_ids=[1, 2], block_ids=[[1]], num_computed=2)


def with_field(msg: Msg, path: str, value: Any) -> bytes:
    """``msg`` encoded with the field at ``path`` (dots and list indexes) set to ``value``."""
    raw = msgspec.msgpack.decode(encode(msg))  # plain dicts and lists (tuples read back as lists)
    *parents, last = path.split(".")
    node: Any = raw
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node[key]
    if isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value
    return msgspec.msgpack.encode(raw)


nan, inf = float("nan"), float("inf")
BAD = [
    # The drills: deadlines that never come, a TP size that divides by zero, a negative length.
    (EXPECT, "timeout_s", inf, "$.timeout_s"),
    (EXPECT, "timeout_s", -inf, "$.timeout_s"),
    (EXPECT, "timeout_s", nan, "$.timeout_s"),
    (EXPECT, "timeout_s", 1e300, "$.timeout_s"),
    (EXPECT, "timeout_s", 0.0, "$.timeout_s"),
    (EXPECT, "timeout_s", -5.0, "$.timeout_s"),
    (EXPECT, "timeout_s", MAX_DEADLINE_S * 2, "$.timeout_s"),
    (EXPECT, "prefill_tp", 0, "$.prefill_tp"),
    (EXPECT, "prefill_tp", -2, "$.prefill_tp"),
    (EXPECT, "prefill_tp", MAX_TP + 1, "$.prefill_tp"),
    (EXPECT, "prompt_len", -1, "$.prompt_len"),
    (EXPECT, "rank", -1, "$.rank"),
    (EXPECT, "block_ids", [[1, -3]], "$.block_ids[0][1]"),
    (ADD, "prompt_len", -64, "$.prompt_len"),
    (ADD, "num_spec", -1, "$.num_spec"),
    (ADD, "remote.tp_size", 0, "$.remote.tp_size"),
    (ADD, "remote.port", 0, "$.remote.port"),
    (ADD, "remote.port", 70000, "$.remote.port"),
    (ADD, "remote.block_ids", [[-1]], "$.remote.block_ids[0][0]"),
    (DONE, "sender_rank", -1, "$.sender_rank"),
    (DONE, "target_rank", -1, "$.target_rank"),
    (DONE, "groups", [-1], "$.groups[0]"),
    (DONE, "bytes", -1, "$.bytes"),
    (Hello(compat_hash="c", engine_id="e", role=Role.DECODE), "rank", -1, "$.rank"),
    (META, "tp_size", 0, "$.tp_size"),
    (META, "ranks.0.tp", 0, "$.ranks[0].tp"),
    (META, "ranks.0.num_blocks", -8, "$.ranks[0].num_blocks"),
    (META, "ranks.0.groups.0.block_size", 0, "$.ranks[0].groups[0].block_size"),
    (META, "ranks.0.placements.0.5", 0, "$.ranks[0].placements[0][5]"),  # ratio
    (META, "ranks.0.placements.0.6.0.1", -1, "$.ranks[0].placements[0][6][0][1]"),
    (META, "ranks.0.regions.0.streams.0.1", -1, "$.ranks[0].regions[0].streams[0][1]"),
    (SIM, "registration.tp_size", 0, "$.registration.tp_size"),
    (
        SIM,
        "registration.groups.0.kernel_block_size",
        0,
        "$.registration.groups[0].kernel_block_size",
    ),
    (SIM, "registration.num_blocks", -1, "$.registration.num_blocks"),
    # An engine's own registration: what would break the layout code or the mappings.
    (ENGINE, "registration.rank", -1, "$.registration.rank"),
    (ENGINE, "registration.tp_size", 0, "$.registration.tp_size"),
    (ENGINE, "registration.num_blocks", 0, "$.registration.num_blocks"),
    (ENGINE, "registration.null_block", -1, "$.registration.null_block"),
    (ENGINE, "registration.memory", [], "$.registration.memory"),
    (ENGINE, "registration.memory.0.1", -4096, "$.registration.memory[0][1]"),
    (ENGINE, "registration.memory.0.2", 0, "$.registration.memory[0][2]"),
    (ENGINE, "registration.memory.0.2", 1 << 60, "$.registration.memory[0][2]"),
    (ENGINE, "registration.groups.0.block_size", 0, "$.registration.groups[0].block_size"),
    (ENGINE, "registration.groups.0.sliding_window", 0, "$.registration.groups[0].sliding_window"),
    (ENGINE, "registration.groups.1.num_spec", -1, "$.registration.groups[1].num_spec"),
    (ENGINE, "registration.layers.0.group", -1, "$.registration.layers[0].group"),
    (ENGINE, "registration.layers.0.buffer", -1, "$.registration.layers[0].buffer"),
    (ENGINE, "registration.layers.0.offset", -2, "$.registration.layers[0].offset"),
    (ENGINE, "registration.layers.0.head_size", -128, "$.registration.layers[0].head_size"),
    (ENGINE, "registration.layers.0.axes.0.1", 0, "$.registration.layers[0].axes[0][1]"),
    (ENGINE, "registration.layers.0.axes.1.2", -256, "$.registration.layers[0].axes[1][2]"),
    (
        ENGINE,
        "registration.layers.1.states.0.shape",
        [1] * 9,
        "$.registration.layers[1].states[0].shape",
    ),
    (
        ENGINE,
        "registration.layers.1.states.0.shape.0",
        0,
        "$.registration.layers[1].states[0].shape[0]",
    ),
    (
        ENGINE,
        "registration.layers.1.states.0.parts.0.1",
        0,
        "$.registration.layers[1].states[0].parts[0][1]",
    ),
    (ENGINE, "registration.model", "m" * 300, "$.registration.model"),
    (LayerReady(rank=0, step=0, layer=0), "layer", -2, "$.layer"),
    (LayerReady(rank=0, step=0, layer=0), "step", -1, "$.step"),
    (BeginStep(rank=0, step=0, slices=[StepSlice("r", 0, 16)]), "slices.0.1", -1, "$.slices"),
    (SAVE, "token_ids", [1, -1], "$.token_ids[1]"),
    (SAVE, "num_computed", -2, "$.num_computed"),
    (PoolLoaded(loaded=1, bytes=1, failed_blocks=[]), "loaded", -1, "$.loaded"),
]


@pytest.mark.parametrize(
    ("msg", "path", "value", "where"),
    BAD,
    ids=[f"{m.__class__.__name__}.{p}={v}" for m, p, v, _ in BAD],
)
def test_out_of_bounds_is_refused_naming_the_field(
    msg: Msg, path: str, value: Any, where: str
) -> None:
    with pytest.raises(ProtocolError) as info:
        decode(with_field(msg, path, value))
    assert where in str(info.value)
    assert msgspec.to_builtins(msg)["type"] in str(info.value)


GOOD = [
    EXPECT,
    msgspec.structs.replace(EXPECT, timeout_s=None),
    msgspec.structs.replace(EXPECT, timeout_s=MAX_DEADLINE_S, prefill_tp=MAX_TP, prompt_len=0),
    msgspec.structs.replace(EXPECT, block_ids=[[0], []]),
    ADD,
    DONE,
    META,
    SIM,
    ENGINE,
    SAVE,
    LayerReady(rank=3, step=0, layer=-1),  # -1: every layer of the step (agent.ALL_LAYERS)
]


@pytest.mark.parametrize("msg", GOOD, ids=[type(m).__name__ for m in GOOD])
def test_in_bounds_round_trips_unchanged(msg: Msg) -> None:
    assert decode(encode(msg)) == msg


# Enums travel by value and decode typed: an unknown value is refused like a number out of range.
BAD_ENUM = [
    (ADD, "mamba_mode", "sideways", "$.mamba_mode"),
    (META, "ranks.0.groups.0.kind", "full", "$.ranks[0].groups[0].kind"),
    (META, "ranks.0.regions.0.kind", "SHARDED", "$.ranks[0].regions[0].kind"),
]


@pytest.mark.parametrize(
    ("msg", "path", "value", "where"),
    BAD_ENUM,
    ids=[f"{m.__class__.__name__}.{p}={v}" for m, p, v, _ in BAD_ENUM],
)
def test_unknown_enum_value_is_refused_naming_it(
    msg: Msg, path: str, value: str, where: str
) -> None:
    with pytest.raises(ProtocolError) as info:
        decode(with_field(msg, path, value))
    text = str(info.value)
    assert "Invalid enum value" in text and repr(value) in text and where in text


def test_enums_decode_typed() -> None:
    add = decode(encode(msgspec.structs.replace(ADD, mamba_mode=MambaMode.ALIGN)))
    assert isinstance(add, AddSend) and add.mamba_mode is MambaMode.ALIGN
    meta = decode(encode(META))
    assert isinstance(meta, AgentMetadata)
    (rank,) = meta.ranks
    assert rank.groups[0].kind is SpecKind.FULL and rank.regions[0].kind is RegionKind.SPLIT
    assert rank.placement(0) == PLACEMENT and hash(rank) == hash(RANK)


def test_remote_target_round_trips_through_json() -> None:
    # The HTTP hop: decode's connector sends to_builtins, prefill's connector converts back.
    assert remote_target(msgspec.json.decode(msgspec.json.encode(TARGET))) == TARGET


@pytest.mark.parametrize(
    ("field", "value", "where"),
    [
        ("port", "5600", "$.port"),  # strict: no coercion from a string
        ("port", 0, "$.port"),
        ("tp_size", 0, "$.tp_size"),
        ("block_ids", [[1, -1]], "$.block_ids[0][1]"),
        ("request_id", None, "$.request_id"),
    ],
)
def test_bad_remote_target_names_the_field(field: str, value: Any, where: str) -> None:
    raw = msgspec.to_builtins(TARGET)
    raw[field] = value
    with pytest.raises(ProtocolError, match="invalid remote target") as info:
        remote_target(raw)
    assert where in str(info.value)


def test_remote_target_missing_field_or_not_an_object() -> None:
    raw = msgspec.to_builtins(TARGET)
    del raw["epoch"]
    with pytest.raises(ProtocolError, match="epoch"):
        remote_target(raw)
    with pytest.raises(ProtocolError, match="invalid remote target"):
        remote_target("tcp://d:5600")


class Recorder:
    def __init__(self) -> None:
        self.seen: list[AnyMsg] = []

    async def __call__(self, msg: AnyMsg, peer: bytes) -> Msg | None:
        self.seen.append(msg)
        return Error(reason="handler reached")


@pytest.mark.parametrize(
    ("path", "value"), [("timeout_s", inf), ("timeout_s", nan), ("prefill_tp", 0)]
)
async def test_server_refuses_before_the_handler(
    ctx: zmq.asyncio.Context, path: str, value: Any
) -> None:
    handler = Recorder()
    server = ControlServer(ctx, "tcp://127.0.0.1:0", handler)
    raw = ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(await server.start())
    try:
        corr = (1).to_bytes(8, "big")
        await raw.send_multipart([corr, with_field(EXPECT, path, value)])
        got_corr, payload = await asyncio.wait_for(raw.recv_multipart(), 5)
        reply = decode(payload)
        assert got_corr == corr and isinstance(reply, Error)
        assert "invalid 'expect_recv' message" in reply.reason and f"$.{path}" in reply.reason
        assert server.rejected == 1 and handler.seen == []
    finally:
        raw.close(linger=0)
        await server.stop()
