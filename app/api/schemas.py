"""Response models of the admin API (pydantic, JSON), separate from the msgspec wire messages.

The wire messages (``app.transfer.wire.protocol``) are what sidecars and engines exchange and are
versioned with the protocol; these models are what operators and scrapers read, and evolve with
the HTTP API. Byte counts are bytes, durations seconds, times ISO 8601 UTC.
"""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from app.kvcache.specs import RegionKind, SpecKind


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class RequestState(StrEnum):
    """``protocol.Status`` by name; the last four are terminal."""

    PENDING = "PENDING"
    TRANSFERRING = "TRANSFERRING"
    DONE = "DONE"
    FAILED = "FAILED"
    ABORTED = "ABORTED"
    EXPIRED = "EXPIRED"


class ErrorResponse(_Model):
    """Every 4xx/5xx answer this API produces itself (FastAPI's 422 keeps its own shape)."""

    detail: str = Field(description="One sentence saying what went wrong and what to do.")


class Liveness(_Model):
    status: Literal["ok"] = "ok"


class Readiness(_Model):
    ready: bool
    reason: str = Field(description="'ready', or why not (e.g. which ranks have not registered).")


# ---- /v1/status ------------------------------------------------------------------------------


class Versions(_Model):
    kv_sidecar: str
    torch: str | None = Field(description="Installed torch distribution; null when absent.")
    mooncake: str | None = Field(description="Installed Mooncake wheel; null when absent.")
    python: str
    protocol: int = Field(description="Wire protocol version spoken with peers and engines.")


class MooncakeStatus(_Model):
    session: str = Field(description="host:rpc_port of the local transfer engine.")
    transport: str
    submits: int = Field(description="Mooncake submissions (per descriptor or per batch).")
    descriptors: int = Field(description="Descriptors confirmed written.")
    bytes: int = Field(description="Bytes confirmed written.")
    failures: int = Field(description="Write calls that raised.")
    reopens: int = Field(
        description="Times a peer's sending lane (its own Mooncake engine) was replaced after a "
        "failed write; the receiving engine is never replaced."
    )


class RankStatus(_Model):
    rank: int
    registered: bool = Field(description="The engine of this rank registered its KV caches.")
    engine_id: str | None = None
    tp_size: int | None = None
    num_blocks: int | None = None
    null_block: int | None = None
    kv_layout: str | None = None
    layout_mode: str | None = None
    groups: int = 0
    regions: int = 0
    sends_in_flight: int = Field(
        default=0, description="Send-side requests not yet in a final state."
    )
    recvs_in_flight: int = Field(
        default=0, description="Receive-side requests not yet in a final state."
    )
    sends_ended: int = Field(
        default=0, description="Send-side requests reported final to the engine."
    )
    recvs_ended: int = Field(
        default=0, description="Receive-side requests reported final to the engine."
    )
    stream_queue_depth: int = Field(
        default=0, description="Layer tasks waiting for the stream thread."
    )
    stream_queue_capacity: int = 0
    layers_signalled_in_forward: int = Field(
        default=0, description="Layers the engine signalled during a forward pass (layer-wise)."
    )
    layers_signalled_at_step_end: int = Field(
        default=0,
        description="Layers signalled only after a forward pass: state layers always; "
        "attention layers here mean the push was not layer-wise.",
    )
    last_step: StepView | None = Field(default=None, description="The last step announced.")


class StatusResponse(_Model):
    engine_id: str
    role: Literal["prefill", "decode", "both"]
    epoch: str = Field(description="Random id of this sidecar start; peers re-handshake on change.")
    ready: bool
    reason: str
    admitting: bool = Field(description="False once shutdown began: new requests are refused.")
    tp_size: int
    compat_hash: str | None = Field(description="Model identity hash; null before registration.")
    control_endpoint: str | None
    engine_ipc: str
    ranks: list[RankStatus] = Field(description="Every configured rank, registered or not.")
    mooncake: MooncakeStatus | None = Field(description="Null before the engine started.")
    handshakes: int
    expired: int = Field(description="Requests ended EXPIRED by their deadline.")
    started_at: datetime
    uptime_s: float
    versions: Versions


# ---- /v1/regions -----------------------------------------------------------------------------


class StreamView(_Model):
    offset: int
    length: int


class RegionView(_Model):
    base: str = Field(description="Start address, hex (0x...).", examples=["0x7f3a2c000000"])
    length: int
    block_stride: int
    kind: RegionKind
    group: int
    layers: list[int]
    streams: list[StreamView]


class RankRegions(_Model):
    rank: int
    tp_size: int
    num_blocks: int
    null_block: int
    kv_layout: str
    layout_mode: str
    regions: list[RegionView]


class RegionsResponse(_Model):
    ranks: list[RankRegions]


# ---- /v1/groups ------------------------------------------------------------------------------


class GroupView(_Model):
    index: int
    spec: SpecKind
    block_size: int = Field(description="Scheduler (manager) block size in tokens.")
    kernel_block_size: int
    sliding_window: int | None
    layers: list[int]
    ranks: list[int] = Field(description="Ranks whose counters are summed here.")
    transfers_ok: int = Field(description="Layer writes that completed.")
    transfers_failed: int = Field(description="Layer writes that failed.")
    bytes: int
    descriptors: int
    layers_sent: int = Field(description="Layer writes that moved at least one descriptor.")
    done: int


class GroupsResponse(_Model):
    groups: list[GroupView]


# ---- /v1/requests ----------------------------------------------------------------------------


class GroupProgressView(_Model):
    group: int
    blocks: int = Field(description="Block ids of this request in this group.")
    block_ids: list[int] = Field(description="This rank's block ids of the request, in order.")
    layers_sent: int | None = Field(
        description="Send: layer writes landed (one per layer per chunk); null on recv."
    )
    bytes: int | None = Field(description="Send: bytes written for this group; null on recv.")
    delivered: bool | None = Field(
        description="Recv: every prefill rank carrying this group reported DONE; null on send."
    )


class LayerTimelineView(_Model):
    step: int
    layer: int = Field(description="The engine's layer index (-1: every layer at once).")
    group: int | None = Field(description="KV cache group; null until written.")
    signalled_at: float = Field(description="When the engine signalled it, Unix time.")
    at_step_end: bool = Field(
        description="Signalled only after the forward pass (vLLM's wait_for_save), not as it "
        "was written: state layers always; attention layers only when the push degraded."
    )
    submitted_at: float | None = Field(description="Its write submitted; null if none yet.")
    landed_at: float | None = Field(description="Its write landed at decode; null if not yet.")
    bytes: int


class StepView(_Model):
    step: int
    began_at: float | None = Field(description="The engine announced it, Unix time.")
    forward_ended_at: float | None = Field(
        description="The engine's forward pass ended (its wait_for_save), Unix time."
    )
    layers_in_forward: int = Field(description="Layers signalled during the forward pass.")
    layers_at_step_end: int = Field(description="Layers signalled only after it.")


class DigestMismatchView(_Model):
    sender_rank: int = Field(description="The prefill rank that wrote the run.")
    layer: int
    group: int
    kind: str = Field(description="The group's kind (full, sliding_window, mla, mamba, ...).")
    block: int = Field(description="Decode's block id the run lies in.")
    bytes: int = Field(description="The run's length.")


class RequestView(_Model):
    id: str
    rank: int
    side: Literal["send", "recv"]
    state: RequestState
    prompt_len: int
    peer: str | None = Field(
        description="Send: the decode control endpoint (null while waiting for the target); "
        "recv: the prefill engine id, if told."
    )
    held_layers: int | None = Field(
        None,
        description="Send admitted before decode's target (concurrent dispatch): layer "
        "signals kept until it arrives, written then; null once it has a target.",
    )
    age_s: float = Field(description="Seconds since the request was admitted on this rank.")
    deadline_in_s: float | None = Field(
        description="Seconds left before EXPIRED (negative: overdue); null once final."
    )
    duration_s: float | None = Field(description="Admission to final state; null until final.")
    bytes: int
    groups: list[GroupProgressView]
    senders: dict[str, str] | None = Field(
        None, description="Recv: prefill rank -> DONE or PENDING (the manifest)."
    )
    targets: list[int] | None = Field(default=None, description="Send: decode ranks written to.")
    reported: bool = Field(description="The engine has been told the final state.")
    quarantined: bool = Field(
        False,
        description="Recv: ended, but a sender may still be writing; the engine is told once "
        "every sender drained or was lost.",
    )
    error: str | None = None
    digest: Literal["off", "sent", "ok", "mismatch", "refused"] = Field(
        "off",
        description="The KV digest (kv_digest.share): off (none computed); send: sent (its "
        "digests went in Done); recv: ok (every digest that came matched), mismatch (bytes "
        "differed: the request failed and decode recomputes it, digest_mismatch says where) or "
        "refused (a digest run outside the request's blocks, or malformed).",
    )
    digest_mismatch: DigestMismatchView | None = Field(
        None, description="Recv: the first run whose digest differed; null otherwise."
    )
    digest_ms: float | None = Field(
        None,
        description="Send: ms its Done waited for the KV digest after the last layer was "
        "written; recv: ms the check of its Dones' digests took (on the request's critical "
        "path both). Null when none was computed.",
    )
    digest_early_layers: int = Field(
        0,
        description="Layers decode checked as they landed, before Done, while prefill computed "
        "later ones (send: those decode confirmed; recv: those it checked). Their time is not "
        "in digest_ms.",
    )
    digest_early_ms: float = Field(
        0.0,
        description="Recv: ms the checks of layers as they landed took (those that matched and "
        "one that did not), off the request's critical path.",
    )
    digest_early_checks: int = Field(
        0, description="Recv: the messages (LayerDigests) those layers came in, each checked once."
    )
    traceparent: str | None = Field(
        None,
        description="W3C trace context the engine passed with the request (from the proxy); "
        'this rank\'s spans are its children (README "Tracing").',
    )
    created_at: float | None = Field(None, description="Admitted on this rank, Unix time.")
    ended_at: float | None = Field(
        None, description="Reached its final state, Unix time; null until then."
    )
    reported_at: float | None = Field(
        None, description="Its end told to the engine, which then has its blocks back."
    )
    claimed_at: float | None = Field(
        None, description="Recv: a prefill rank first claimed it (had decode's target)."
    )
    layers: list[LayerTimelineView] | None = Field(
        None,
        description="Send, in GET /v1/requests/{id} only: each layer of each step, signalled, "
        "submitted, landed and bytes.",
    )
    steps: list[StepView] | None = Field(
        None,
        description="Send, in GET /v1/requests/{id} only: the forward steps it was in.",
    )


class RequestList(_Model):
    count: int
    requests: list[RequestView]


class RequestLookup(_Model):
    id: str
    entries: list[RequestView] = Field(description="One per (rank, side) holding the id.")


class AbortBody(_Model):
    reason: str = Field(default="aborted by operator", min_length=1, max_length=500)


class AbortResponse(_Model):
    id: str
    aborted: list[int] = Field(description="Ranks on which this call ended the request.")
    entries: list[RequestView]


class KVTargetBody(_Model):
    """Decode's connector (the prefill-first flow): where a send this sidecar holds goes."""

    transfer_id: str = Field(min_length=1, max_length=256)
    target: dict[str, Any] | None = Field(
        default=None, description="Decode's RemoteTarget (its sidecar and block ids)."
    )
    error: str | None = Field(
        default=None, max_length=1000, description="Why decode cannot take the transfer."
    )
    # Pipeline parallel: decode's stage k posts to the URL of prefill's stage k (its ``{pp}``
    # replaced), so the sidecar takes these as said and checks the target's signature only.
    pp_stage: int = Field(default=0, ge=0, lt=64, description="Decode's pipeline stage.")
    pp_size: int = Field(default=1, ge=1, le=64, description="Decode's pipeline stages.")


class KVTargetResponse(_Model):
    transfer_id: str
    ranks: list[int] = Field(description="Ranks whose send took the target (or was aborted).")


# ---- /v1/peers -------------------------------------------------------------------------------


class PeerView(_Model):
    endpoint: str = Field(description="Control endpoint of the peer (tcp://host:port).")
    engine_id: str | None
    epoch: str | None
    te_session: str | None = Field(description="The peer's Mooncake session (host:port).")
    ranks: list[int] = Field(description="Peer ranks learnt at the last handshake.")
    last_handshake: datetime | None
    handshakes: int
    failures: int
    last_error: str | None
    heard_s_ago: float = Field(
        description="Seconds since the peer last answered or wrote to us; past the lease "
        "(lease_s) while sharing requests, it is declared lost."
    )


class PeersResponse(_Model):
    peers: list[PeerView]


class RegistrationResponse(_Model):
    ranks: dict[str, Any] = Field(
        description="Per rank registered from a real engine: its registration as the engine "
        "sent it (shared-memory files, groups, each layer's tensor geometry)."
    )


class PoolLookupBody(_Model):
    """A prompt the proxy weighs (its second tier): how much of it the pool could serve."""

    token_ids: list[int] = Field(
        min_length=1,
        max_length=131072,
        description="The whole prompt; the hit leaves its last token, as the engine's does.",
    )
    cache_salt: str | None = Field(
        default=None,
        max_length=1024,
        description="The request's cache_salt: a salted prompt is scored on its tenant's "
        "entries only.",
    )
    model: str | None = Field(
        default=None,
        max_length=256,
        description="The request's model: a LoRA adapter's name keys the adapter (no hit for "
        "one no engine of this sidecar has used).",
    )


class PoolLookupResponse(_Model):
    hit_tokens: int = Field(
        description="Leading tokens the pool serves, as vLLM's hybrid coordinator would take "
        "them (0: none, or no rank registered yet)."
    )
    block_size: int = Field(description="The tokens of one block (0: no rank registered yet).")


class PoolCallView(_Model):
    kind: Literal["save", "load"]
    request: str = Field(description="The engine's request id.")
    rank: int
    tokens: int = Field(description="The prefix stored, or the hit loaded.")
    held_tokens: int = Field(description="A load's tokens the engine's own cache held.")
    blocks: list[list[int]] = Field(description="Per group, the block indices stored or loaded.")
    block_ids: list[list[int]] = Field(description="Per group, the request's block table.")
    started_at: float = Field(description="Unix seconds: the call reached the pool service.")
    ended_at: float | None = Field(
        description="Unix seconds: the store answered (null: its call still runs)."
    )
    state: Literal["done", "running", "late"] = Field(
        default="done",
        description="done: answered in time; running: the store call has not returned (past "
        "the pool's timeout the engine holds the request's blocks for it); late: it returned "
        "after the timeout, the engine held the blocks until then.",
    )


class PoolResponse(_Model):
    enabled: bool = Field(description="Whether this sidecar has a Mooncake Store pool client.")
    master_address: str | None
    lookups: int = Field(description="Lookups served (one batched existence check each).")
    hit_tokens: int = Field(description="Tokens served by pool hits, summed over lookups.")
    hits: int = Field(description="Keys found by existence checks.")
    misses: int = Field(description="Keys not found by existence checks.")
    keys_put: int
    keys_skipped: int = Field(description="Puts skipped because the key already existed.")
    keys_got: int
    bytes_put: int
    bytes_got: int
    backpressure: int = Field(description="Keys not stored because the pool was full (-200).")
    failures: int
    timeouts: int
    late_returns: int = Field(
        default=0, description="Store calls that returned after their timeout (calls)."
    )
    late_running: int = Field(
        default=0, description="Store calls past their timeout running now (a gauge)."
    )
    late_loads: int = Field(default=0, description="Engine loads answered pending (late).")
    late_saves: int = Field(default=0, description="Engine saves answered pending (late).")
    late_released: int = Field(
        default=0, description="Late calls returned since: their blocks given back."
    )
    late_stuck: int = Field(
        default=0,
        description="Late calls still running past quarantine_max_s (blocks kept anyway).",
    )
    recent: list[PoolCallView] = Field(
        default=[], description="The last engine saves and loads, oldest first."
    )


class KVDigestBody(_Model):
    """The share of requests whose KV is digested from now on (``kv_digest.share``)."""

    share: float = Field(
        ge=0.0,
        le=1.0,
        description="0 turns the digest off, 1 checks every request (incident hunting); the "
        "settings' value returns at the next start.",
    )


class KVDigestResponse(_Model):
    share: float = Field(description="The share in force (prefill's pushes and the pool's pages).")
    previous: float | None = Field(None, description="The share before this change (PUT only).")
