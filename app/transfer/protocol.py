"""Wire messages (DESIGN §4): msgspec Structs, msgpack-encoded, tagged, versioned. Never pickle.

Two channels use them: sidecar <-> sidecar (the control port: Hello / AgentMetadata / Rejected,
Done / Ack, Abort) and engine <-> its sidecar (the IPC socket: register, admit, layer ready,
finished). Every message carries ``version``; a frame that does not decode, or decodes to an
unknown version, is answered with ``Error`` and counted by the receiver.
"""

from __future__ import annotations

from enum import IntEnum

import msgspec

from app.errors import ProtocolError
from app.kvcache.desc import GroupDesc, LayoutDesc
from app.kvcache.engine_spec import EngineRegistration
from app.kvcache.layout import LayerPlacement, Piece, Region, Stream
from app.kvcache.specs import RegionKind, SpecKind

PROTOCOL_VERSION = 1


class Status(IntEnum):
    """Terminal (and in-flight) states of a request; the same numbers on both sides."""

    PENDING = 0
    TRANSFERRING = 1
    DONE = 2
    FAILED = 3
    ABORTED = 4
    EXPIRED = 5

    @property
    def terminal(self) -> bool:
        return self >= Status.DONE


class Role(IntEnum):
    PREFILL = 0
    DECODE = 1
    BOTH = 2


class Msg(msgspec.Struct, tag_field="type", kw_only=True):
    version: int = PROTOCOL_VERSION


# ---- layout description on the wire --------------------------------------------------------


class WirePiece(msgspec.Struct, array_like=True):
    name: str
    offset: int
    outer: int
    outer_stride: int
    units: int
    unit_first: int
    unit_count: int
    unit_stride: int
    unit_bytes: int


class WirePlacement(msgspec.Struct, array_like=True):
    layer: int
    group: int
    base: int
    block_stride: int
    kernel_stride: int
    ratio: int
    pieces: list[WirePiece]
    buffer: int


class WireStream(msgspec.Struct, array_like=True):
    offset: int
    length: int


class WireRegion(msgspec.Struct):
    base: int
    length: int
    block_stride: int
    kind: str
    group: int
    layers: list[int]
    streams: list[WireStream]


class WireGroup(msgspec.Struct):
    index: int
    kind: str
    block_size: int
    kernel_block_size: int
    layers: list[int]
    sliding_window: int | None = None


# ---- sidecar <-> sidecar -------------------------------------------------------------------


class Hello(Msg, tag="hello"):
    compat_hash: str
    engine_id: str
    role: Role
    rank: int = 0
    epoch: str = ""


class RankMetadata(msgspec.Struct):
    rank: int
    tp_size: int
    num_blocks: int
    null_block: int
    kv_layout: str
    layout_mode: str
    compat_hash: str
    groups: list[WireGroup]
    regions: list[WireRegion]
    placements: list[WirePlacement]


class AgentMetadata(Msg, tag="agent_metadata"):
    engine_id: str
    epoch: str
    tp_size: int
    te_session: str
    ranks: list[RankMetadata]
    state_tokens_convention: str = "prompt_len-1"


class Rejected(Msg, tag="rejected"):
    reason: str


class Done(Msg, tag="done"):
    request: str
    sender_engine: str
    sender_rank: int
    target_rank: int
    epoch: str
    status: Status
    groups: list[int]
    bytes: int = 0
    error: str | None = None


class Ack(Msg, tag="ack"):
    request: str
    ok: bool = True
    error: str | None = None


class Abort(Msg, tag="abort"):
    request: str
    reason: str


class Error(Msg, tag="error"):
    reason: str


# ---- engine <-> its sidecar ----------------------------------------------------------------


class RegisterCaches(Msg, tag="register"):
    """An engine rank's KV cache: the layout parameters and the shared-memory names, in order."""

    engine_id: str
    rank: int
    tp_size: int
    model: str
    layers: int | None
    dtype: str | None
    cache_dtype: str
    block_size: int
    num_blocks: int
    layout_mode: str
    kv_layout: str
    heads_major: bool
    shm_names: list[str]


class RegisterEngine(Msg, tag="register_engine"):
    """An engine rank's KV cache as the engine itself allocated it (DESIGN §2a)."""

    registration: EngineRegistration


class RemoteTarget(msgspec.Struct):
    """Where a request's KV goes: D's sidecar control address, epoch and block ids."""

    host: str
    port: int
    engine_id: str
    epoch: str
    tp_size: int
    block_ids: list[list[int]]


class AddSend(Msg, tag="add_send"):
    rank: int
    request: str
    prompt_len: int
    block_ids: list[list[int]]
    remote: RemoteTarget
    mamba_mode: str = "none"
    num_spec: int = 0


class ExpectRecv(Msg, tag="expect_recv"):
    rank: int
    request: str
    prompt_len: int
    block_ids: list[list[int]]
    prefill_tp: int
    prefill_engine: str = ""
    timeout_s: float | None = None


class StepSlice(msgspec.Struct, array_like=True):
    """Tokens ``[start, end)`` of a request in this step; ``block_ids`` when its prefill
    blocks grew since admission (chunked prefill allocates as it goes)."""

    request: str
    start: int
    end: int
    block_ids: list[list[int]] | None = None


class BeginStep(Msg, tag="begin_step"):
    rank: int
    step: int
    slices: list[StepSlice]


class LayerReady(Msg, tag="layer_ready"):
    rank: int
    step: int
    layer: int


class SidecarInfo(Msg, tag="sidecar_info"):
    """Where peers reach this sidecar and under which epoch (for the engine's router targets)."""


class GetFinished(Msg, tag="get_finished"):
    rank: int


class FailedRequest(msgspec.Struct):
    request: str
    status: Status
    block_ids: list[list[int]]
    error: str


class Finished(Msg, tag="finished"):
    sending: list[str]
    recving: list[str]
    failed: list[FailedRequest]
    bytes: int = 0
    descriptors: int = 0


class AbortRequest(Msg, tag="abort_request"):
    rank: int
    request: str
    reason: str


class PoolLookup(Msg, tag="pool_lookup"):
    rank: int
    request: str
    token_ids: list[int]
    extra_keys: list[str] = []


class PoolSave(Msg, tag="pool_save"):
    """Store a request's fully computed blocks; the engine keeps them until the reply."""

    rank: int
    request: str
    token_ids: list[int]
    block_ids: list[list[int]]
    num_computed: int
    extra_keys: list[str] = []


class PoolLoad(Msg, tag="pool_load"):
    rank: int
    request: str
    token_ids: list[int]
    block_ids: list[list[int]]
    hit_tokens: int
    extra_keys: list[str] = []


class PoolLoaded(Msg, tag="pool_loaded"):
    loaded: int
    bytes: int
    failed_blocks: list[list[int]]


class Reply(Msg, tag="reply"):
    ok: bool = True
    error: str | None = None
    data: dict[str, str | int | float | bool | None] = {}


AnyMsg = (
    Hello
    | AgentMetadata
    | Rejected
    | Done
    | Ack
    | Abort
    | Error
    | RegisterCaches
    | RegisterEngine
    | AddSend
    | ExpectRecv
    | BeginStep
    | LayerReady
    | GetFinished
    | SidecarInfo
    | Finished
    | AbortRequest
    | Reply
    | PoolLookup
    | PoolSave
    | PoolLoad
    | PoolLoaded
)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(AnyMsg)


def encode(msg: Msg) -> bytes:
    return _encoder.encode(msg)


def decode(frame: bytes) -> AnyMsg:
    """Decode one frame; ProtocolError says what was wrong with it."""
    try:
        msg = _decoder.decode(frame)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        # A newer peer's message may not fit our structs: name the version, not the field.
        version = _peek_version(frame)
        if version is not None and version != PROTOCOL_VERSION:
            raise ProtocolError(
                f"protocol version {version} is not supported; this sidecar speaks "
                f"{PROTOCOL_VERSION}"
            ) from None
        raise ProtocolError(f"malformed frame ({len(frame)} bytes): {e}") from None
    if msg.version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"protocol version {msg.version} is not supported; this sidecar speaks "
            f"{PROTOCOL_VERSION}"
        )
    return msg


def _peek_version(frame: bytes) -> int | None:
    try:
        raw = msgspec.msgpack.decode(frame)
    except msgspec.DecodeError:
        return None
    version = raw.get("version") if isinstance(raw, dict) else None
    return version if isinstance(version, int) else None


def rank_metadata(desc: LayoutDesc) -> RankMetadata:
    return RankMetadata(
        rank=desc.rank,
        tp_size=desc.tp,
        num_blocks=desc.num_blocks,
        null_block=desc.null_block,
        kv_layout=desc.kv_layout,
        layout_mode=desc.layout_mode,
        compat_hash=desc.compat_hash,
        groups=[
            WireGroup(
                g.index,
                g.kind.value,
                g.block_size,
                g.kernel_block_size,
                list(g.layers),
                g.sliding_window,
            )
            for g in desc.groups
        ],
        regions=[
            WireRegion(
                r.base,
                r.length,
                r.block_stride,
                r.kind.value,
                r.group,
                list(r.layers),
                [WireStream(s.offset, s.length) for s in r.streams],
            )
            for r in desc.regions
        ],
        placements=[
            WirePlacement(
                p.layer,
                p.group,
                p.base,
                p.block_stride,
                p.kernel_stride,
                p.ratio,
                [WirePiece(*_piece_fields(x)) for x in p.pieces],
                p.buffer,
            )
            for p in desc.placements
        ],
    )


def _piece_fields(p: Piece | WirePiece) -> tuple[str, int, int, int, int, int, int, int, int]:
    return (
        p.name,
        p.offset,
        p.outer,
        p.outer_stride,
        p.units,
        p.unit_first,
        p.unit_count,
        p.unit_stride,
        p.unit_bytes,
    )


def layout_desc(m: RankMetadata) -> LayoutDesc:
    """The planner's view of a remote rank, from its metadata."""
    return LayoutDesc(
        compat_hash=m.compat_hash,
        tp=m.tp_size,
        rank=m.rank,
        num_blocks=m.num_blocks,
        null_block=m.null_block,
        kv_layout=m.kv_layout,
        layout_mode=m.layout_mode,
        groups=tuple(
            GroupDesc(
                g.index,
                SpecKind(g.kind),
                g.block_size,
                g.kernel_block_size,
                tuple(g.layers),
                g.sliding_window,
            )
            for g in m.groups
        ),
        placements=tuple(
            LayerPlacement(
                p.layer,
                p.group,
                p.base,
                p.block_stride,
                p.kernel_stride,
                p.ratio,
                tuple(Piece(*_piece_fields(x)) for x in p.pieces),
                p.buffer,
            )
            for p in m.placements
        ),
        regions=tuple(
            Region(
                r.base,
                r.length,
                r.block_stride,
                RegionKind(r.kind),
                r.group,
                tuple(r.layers),
                tuple(Stream(s.offset, s.length) for s in r.streams),
            )
            for r in m.regions
        ),
    )
