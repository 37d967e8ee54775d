"""What the scheduler side tells the worker side each step (vLLM connector metadata)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from app.connectors.vllm.config import DEFAULT_TARGET_TIMEOUT_S
from app.transfer.protocol import RemoteTarget

BlockIds = list[list[int]]


@dataclass(frozen=True)
class Admit:
    """A prefill request to admit at the sidecar: ``sid`` is the id both sidecars use.

    Without ``remote`` each worker fetches decode's target from ``router_url`` (concurrent
    dispatch) and hands it to its sidecar rank, or, without a router either (prefill first),
    decode posts it to the sidecar, which keeps the send at most ``target_timeout_s``."""

    req_id: str
    sid: str
    prompt_len: int
    block_ids: BlockIds
    remote: RemoteTarget | None
    mamba_mode: str = "none"
    num_spec: int = 0
    router_url: str | None = None
    target_timeout_s: float = DEFAULT_TARGET_TIMEOUT_S
    traceparent: str | None = None  # W3C, from kv_transfer_params: the send's spans' parent


@dataclass(frozen=True)
class Expect:
    """A decode request every worker's sidecar rank expects; rank 0 then posts its target."""

    req_id: str
    sid: str
    prompt_len: int
    block_ids: BlockIds
    computed: int  # prompt tokens decode's own prefix cache holds: prefill skips them
    router_url: str | None
    traceparent: str | None = None  # W3C, from kv_transfer_params: the receive span's parent


@dataclass(frozen=True)
class Slice:
    """Prompt tokens ``[start, end)`` of a send computed this step; blocks when they grew."""

    sid: str
    start: int
    end: int
    block_ids: BlockIds | None = None


@dataclass(frozen=True)
class PoolJob:
    """Load ``tokens`` pool-hit tokens into, or store the first ``tokens`` tokens from, a
    request's blocks (per group)."""

    req_id: str
    token_ids: list[int]
    block_ids: BlockIds
    tokens: int


@dataclass
class KVSidecarMetadata(KVConnectorMetadata):
    admits: list[Admit] = field(default_factory=list)
    slices: list[Slice] = field(default_factory=list)
    expects: list[Expect] = field(default_factory=list)
    pool_loads: list[PoolJob] = field(default_factory=list)
    pool_saves: list[PoolJob] = field(default_factory=list)
