"""Wire messages (DESIGN §4): msgspec Structs, msgpack-encoded, tagged, versioned. Never pickle.

Two channels use them: sidecar <-> sidecar (the control port: Hello / AgentMetadata / Rejected,
Claim / LayerDigests / Done / Ack, Abort, Ping / Pong, NewEpoch) and engine <-> its sidecar (the
IPC socket: register, admit, layer ready, finished). Every message carries ``version``; a frame
that does not decode (``codec``), or decodes to an unknown version, is answered with ``Error``
and counted by the receiver.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Annotated, Literal

import msgspec

from app.devices.spec import MAX_RING_SLOTS
from app.kvcache.bounds import MAX_TP as MAX_TP
from app.kvcache.bounds import Index, NonNegInt, TpSize
from app.kvcache.desc import LayoutDesc
from app.kvcache.digest import DigestRuns
from app.kvcache.engine_spec import EngineRegistration
from app.tracing.traceparent import PATTERN as TRACEPARENT_PATTERN
from app.transfer.planning.planner import MambaMode

PROTOCOL_VERSION = 2

# Bounds a message must meet to decode at all (DESIGN §4): a peer or an engine that sends a rank
# of -1, a TP size of 0 or a deadline of NaN gets a ProtocolError naming the field, instead of a
# ZeroDivisionError deep in the planner or a request that never expires.
MAX_DEADLINE_S = 3600.0  # the settings' deadline bound

# -1 is agent.ALL_LAYERS: every layer of the step is ready.
LayerOrAll = Annotated[int, msgspec.Meta(ge=-1)]
Port = Annotated[int, msgspec.Meta(ge=1, le=65535)]
# gt=0 also rejects NaN (every comparison with NaN is false) and le rejects inf and 1e300.
Deadline = Annotated[float, msgspec.Meta(gt=0, le=MAX_DEADLINE_S)]
BlockIds = list[list[Index]]
"""Block ids per KV cache group."""
# A host as the settings take one (``advertise_host``): a DNS name of RFC 1123 labels, a dotted
# IPv4 address or an IPv6 literal. Anything else (spaces, a scheme, a path) would be refused by
# libzmq only once a connection is tried, or would connect somewhere unintended.
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_NAME = rf"(?=.{{1,253}}$){_LABEL}(?:\.{_LABEL})*"
_IPV6 = r"(?=.{2,45}$)[0-9A-Fa-f.]*:[0-9A-Fa-f.]*:[0-9A-Fa-f:.]*"  # two colons at least
HOST_PATTERN = rf"^(?:{_NAME}|{_IPV6})$"
Host = Annotated[str, msgspec.Meta(pattern=HOST_PATTERN)]
# Ids are ours (uuids, engine ids, epochs): a few dozen characters. The bound keeps a stranger's
# megabyte id out of records, answers and logs.
MAX_ID_CHARS = 256
Id = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_ID_CHARS)]
# Requests one heartbeat names (``Ping.sending``): at most half the default control frame cap
# however long the ids; more sends in flight to one peer than this is far past any engine's batch.
MAX_SENDING = 2048
# The connector passes on only a traceparent it parsed (README "Tracing"); anything else from
# an engine is a malformed frame.
TraceParentHeader = Annotated[str, msgspec.Meta(pattern=TRACEPARENT_PATTERN)]
# An HMAC-SHA256 in hex (app.transfer.wire.target_auth), or "" for none.
Signature = Annotated[str, msgspec.Meta(pattern="^([0-9a-f]{64})?$")]
# A prompt's SHA-256 in hex (target_auth.prompt_digest), or "" for none.
PromptDigest = Annotated[str, msgspec.Meta(pattern="^([0-9a-f]{64})?$")]
# The format of the targets this release signs: 2 binds decode's prompt (``prompt_digest``). A
# target without the field is of format 1, from an older decode, and refused by name.
TARGET_FORMAT = 2


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


# ---- sidecar <-> sidecar -------------------------------------------------------------------


class Hello(Msg, tag="hello"):
    compat_hash: str
    engine_id: str
    role: Role
    rank: Index = 0
    epoch: str = ""
    # The sender's own control endpoint: decode asks it to drain before freeing blocks.
    control: str = ""
    # Its engine's speculative decoding settings ("" when off): decode's must equal them.
    speculative: str = ""
    # The transfer that needs this handshake ("" when none): a decode that refuses the
    # handshake ends that load now, with the reason, instead of at its deadline.
    request: str = ""


class AgentMetadata(Msg, tag="agent_metadata"):
    engine_id: str
    epoch: str
    tp_size: TpSize
    te_session: str
    # Each rank's layout as the planner reads it (validated on decode by its field bounds).
    ranks: list[LayoutDesc]
    state_tokens_convention: str = "prompt_len-1"


class Rejected(Msg, tag="rejected"):
    reason: str


class Done(Msg, tag="done"):
    request: str
    sender_engine: str
    sender_rank: Index
    target_rank: Index
    epoch: str
    status: Status
    groups: list[Index]
    bytes: NonNegInt = 0
    error: str | None = None
    digests: DigestRuns | None = None  # sampled (issue 51); an older prefill sends none


class LayerDigests(Msg, tag="layer_digests"):
    """Digests of layers of a request that already landed at decode, sent by the prefill rank
    that wrote them while its engine computes later ones (issue 51): decode checks them now, and
    the ``Done`` carries only the layers no ``Ack`` with ``ok`` answered. A decode that predates
    this message answers ``Error``; prefill then sends every layer's digests in ``Done``."""

    request: str
    sender_engine: str
    sender_rank: Index
    target_rank: Index
    epoch: str
    digests: DigestRuns


class Ack(Msg, tag="ack"):
    request: str
    ok: bool = True
    error: str | None = None


class Abort(Msg, tag="abort"):
    """Either side ended a request. The answer (``Ack``) means the answerer has no write in
    flight for it any more, so decode may hand its blocks back to its engine."""

    request: str
    reason: str
    sender_engine: str = ""


class Ping(Msg, tag="ping"):
    """Heartbeat between peers that share requests; the answer is a ``Pong``."""

    engine_id: str
    epoch: str
    # Prefill to decode: the requests it claimed there and still sends (each progressed within
    # prefill's send_timeout_s, or it would have ended). Decode's receive of each waits its
    # idle bound (recv_timeout_s) anew: a long prefill's transfer follows its progress.
    sending: Annotated[list[Id], msgspec.Meta(max_length=MAX_SENDING)] = []


class Pong(Msg, tag="pong"):
    epoch: str
    # False: this sidecar declared the pinger lost (its lease ran out); it must stop writing.
    known: bool = True


class Claim(Msg, tag="claim"):
    """Prefill announces, before its first write, that ``sender_rank`` of ``sender_engine`` will
    write request ``request`` into these decode blocks; decode refuses unless they are the
    request's own. Decode then knows whom to ask to drain before it frees the blocks."""

    request: str
    sender_engine: str
    sender_rank: Index
    target_rank: Index
    epoch: str
    block_ids: BlockIds


class NewEpoch(Msg, tag="new_epoch"):
    """The sender's engine registered anew: requests that target ``old`` must stop writing.
    The ``Ack`` means the receiver has no write in flight to the old memory."""

    engine_id: str
    old: str
    new: str


class Error(Msg, tag="error"):
    reason: str


# ---- engine <-> its sidecar ----------------------------------------------------------------


class RegisterEngine(Msg, tag="register_engine"):
    """An engine rank's KV cache as the engine itself allocated it (DESIGN §2a)."""

    registration: EngineRegistration


class RemoteTarget(msgspec.Struct):
    """Where a request's KV goes: D's sidecar control address, epoch and block ids.

    Decode's connector builds it and it reaches prefill's connector as JSON (through the proxy,
    in ``kv_transfer_params["remote"]``): ``msgspec.to_builtins`` there, ``remote_target``
    here, so both ends read one definition and a bad field is named before anything is sent.
    """

    request_id: Id  # the id both sidecars know the transfer by (the proxy's transfer id)
    host: Host
    port: Port
    engine_id: Id
    epoch: Id
    tp_size: TpSize
    block_ids: BlockIds
    # Prompt tokens decode already holds (its own prefix cache): prefill sends from here on.
    computed: NonNegInt = 0
    # The prompt decode holds for this transfer (target_auth.prompt_digest): prefill's sidecar
    # writes only for a send whose prompt has this digest.
    prompt_digest: PromptDigest = ""
    # Set by the signer; absent (1) in targets of releases that bound no prompt.
    format: Annotated[int, msgspec.Meta(ge=1)] = 1
    # Decode's sidecar's signature over the fields above (app.transfer.wire.target_auth): prefill's
    # sidecar uses no target without a good one.
    signature: Signature = ""


class AddSend(Msg, tag="add_send"):
    """Admit a send. Without ``remote`` (concurrent dispatch, prefill first) the sidecar keeps
    the layers the engine signals until ``SetTarget`` says where they go, or the target deadline
    (``target_timeout_s``, else the send deadline) passes."""

    rank: Index
    request: str
    prompt_len: NonNegInt
    block_ids: BlockIds
    remote: RemoteTarget | None = None
    mamba_mode: MambaMode = MambaMode.NONE
    num_spec: NonNegInt = 0
    target_timeout_s: Deadline | None = None
    # W3C trace context of the prefill request: the send's spans are its children.
    traceparent: TraceParentHeader | None = None
    # Digest of the whole prompt prefill's engine runs (decode's view: before prefill drops
    # the last token): only a target signed for this prompt is taken.
    prompt_digest: PromptDigest = ""


class SetTarget(Msg, tag="set_target"):
    """Where an admitted send's KV goes, once decode allocated it (concurrent dispatch)."""

    rank: Index
    request: str
    remote: RemoteTarget


class ExpectRecv(Msg, tag="expect_recv"):
    rank: Index
    request: str
    prompt_len: NonNegInt
    block_ids: BlockIds
    prefill_tp: TpSize
    prefill_engine: str = ""
    # Once a prefill claimed the blocks, its writes get this long (the sidecar's
    # recv_timeout_s when None).
    timeout_s: Deadline | None = None
    # How long to wait for a prefill to claim them at all: its request may sit in prefill's
    # queue (the sidecar's recv_queue_timeout_s when None, else timeout_s).
    queue_timeout_s: Deadline | None = None
    # W3C trace context of the decode request: the receive's span is its child.
    traceparent: TraceParentHeader | None = None
    # Digest of the prompt decode holds: its target binds it (target_auth.prompt_digest).
    prompt_digest: PromptDigest = ""


class StepSlice(msgspec.Struct, array_like=True):
    """Tokens ``[start, end)`` of a request in this step; ``block_ids`` when its prefill
    blocks grew since admission (chunked prefill allocates as it goes)."""

    request: str
    start: NonNegInt
    end: NonNegInt
    block_ids: BlockIds | None = None


class BeginStep(Msg, tag="begin_step"):
    """A step is about to run: the requests it admits and expects, then its token slices.

    One-way, before the forward pass: the engine never waits for the sidecar here. A refused
    admission reaches the engine as a failed request in its next ``GetFinished``. ``step`` only
    counts when ``slices`` is not empty (a decode step announces only expects)."""

    rank: Index
    step: NonNegInt
    slices: list[StepSlice]
    admits: list[AddSend] = []
    expects: list[ExpectRecv] = []


class LayerReady(Msg, tag="layer_ready"):
    """Layer ``layer`` of ``step`` was written; with ``slot >= 0`` only once use ``seq`` of
    that slot of the rank's event ring completed (the sidecar waits on it before writing)."""

    rank: Index
    step: NonNegInt
    layer: LayerOrAll
    slot: Annotated[int, msgspec.Meta(ge=-1, lt=MAX_RING_SLOTS)] = -1  # -1: no event
    seq: NonNegInt = 0
    # Signalled only after the forward pass (vLLM's wait_for_save), not as it was written.
    at_step_end: bool = False


class EndStep(Msg, tag="end_step"):
    """The forward pass of ``step`` ended (one-way; the per-layer timeline's reference)."""

    rank: Index
    step: NonNegInt


class SidecarInfo(Msg, tag="sidecar_info"):
    """Where peers reach this sidecar and under which epoch (for the engine's router targets)."""


class SignTargets(Msg, tag="sign_targets"):
    """Decode's connector asks its sidecar to sign targets that name this sidecar (the
    connector never holds the key); answered with :class:`SignedTargets`, in order."""

    targets: list[RemoteTarget]


class SignedTargets(Msg, tag="signed_targets"):
    targets: list[RemoteTarget]


class GetFinished(Msg, tag="get_finished"):
    rank: Index


class FailedRequest(msgspec.Struct):
    request: str
    status: Status
    block_ids: BlockIds
    error: str


class RequestTotals(msgspec.Struct, frozen=True):
    """What one rank moved for one request it reports ended: the engine's transfer stats."""

    request: str
    side: Literal["send", "recv"]
    status: Status
    bytes: NonNegInt
    duration_s: Annotated[float, msgspec.Meta(ge=0)]  # admission to the final state


class Finished(Msg, tag="finished"):
    sending: list[str]
    recving: list[str]
    failed: list[FailedRequest]
    bytes: NonNegInt = 0
    descriptors: NonNegInt = 0
    totals: list[RequestTotals] = []  # one per request in sending, recving and failed


class AbortRequest(Msg, tag="abort_request"):
    rank: Index
    request: str
    reason: str


# vLLM's extra keys of a prompt's hash blocks, as runs: ``(blocks, keys)`` names the next
# ``blocks`` hash blocks' keys, 0 blocks this and every later one (``app.store.hashing``); no runs:
# no block has extra keys. Keys are vLLM's own tuples (str, int, bytes, None), arrays on the wire.
KeyRuns = list[tuple[NonNegInt, list[object]]]


class PoolLookup(Msg, tag="pool_lookup"):
    rank: Index
    request: str
    token_ids: list[Index]
    extra_keys: KeyRuns = []


class PoolSave(Msg, tag="pool_save"):
    """Store a request's fully computed blocks; the engine keeps them until the reply."""

    rank: Index
    request: str
    token_ids: list[Index]
    block_ids: BlockIds
    num_computed: NonNegInt
    extra_keys: KeyRuns = []
    # Tokens this request's earlier saves stored: blocks ending at or before them are skipped.
    stored_tokens: NonNegInt = 0


class PoolLoad(Msg, tag="pool_load"):
    rank: Index
    request: str
    token_ids: list[Index]
    block_ids: BlockIds
    hit_tokens: NonNegInt
    extra_keys: KeyRuns = []
    # Tokens the engine's own prefix cache already put in place: never fetched again (its
    # blocks are shared with other requests).
    held_tokens: NonNegInt = 0


class PoolLoaded(Msg, tag="pool_loaded"):
    loaded: NonNegInt
    bytes: NonNegInt
    failed_blocks: BlockIds
    # The get ran past the pool's timeout and may still write the blocks: nothing is decided;
    # the engine keeps them (the request waits) and asks with ``PoolPoll`` until it returned.
    pending: bool = False


class PoolPoll(Msg, tag="pool_poll"):
    """Which of these loads and saves, answered pending, still run in the store."""

    rank: Index
    loads: list[Id] = []
    saves: list[Id] = []


class PoolRunning(Msg, tag="pool_running"):
    """The reply to ``PoolPoll``: those still running. Every other one asked about is settled
    (returned, or never reached the store): its blocks are the engine's again."""

    loads: list[Id] = []
    saves: list[Id] = []


class Reply(Msg, tag="reply"):
    ok: bool = True
    error: str | None = None
    data: dict[str, str | int | float | bool | None] = {}


AnyMsg = (
    Hello
    | AgentMetadata
    | Rejected
    | Done
    | LayerDigests
    | Ack
    | Abort
    | Ping
    | Pong
    | Claim
    | NewEpoch
    | Error
    | RegisterEngine
    | AddSend
    | SetTarget
    | ExpectRecv
    | BeginStep
    | LayerReady
    | EndStep
    | GetFinished
    | SidecarInfo
    | SignTargets
    | SignedTargets
    | Finished
    | AbortRequest
    | Reply
    | PoolLookup
    | PoolSave
    | PoolLoad
    | PoolLoaded
    | PoolPoll
    | PoolRunning
)


def tcp_endpoint(host: str, port: int) -> str:
    """The ZMQ endpoint of a control port (an IPv6 literal in brackets)."""
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"
