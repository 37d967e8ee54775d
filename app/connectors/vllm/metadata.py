"""What the scheduler side tells the worker side each step (vLLM connector metadata)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from app.transfer.protocol import RemoteTarget

BlockIds = list[list[int]]


@dataclass(frozen=True)
class Admit:
    """A prefill request to admit at the sidecar: ``sid`` is the id both sidecars use."""

    req_id: str
    sid: str
    prompt_len: int
    block_ids: BlockIds
    remote: RemoteTarget
    mamba_mode: str = "none"
    num_spec: int = 0


@dataclass(frozen=True)
class Slice:
    """Prompt tokens ``[start, end)`` of a send computed this step; blocks when they grew."""

    sid: str
    start: int
    end: int
    block_ids: BlockIds | None = None


@dataclass(frozen=True)
class Target:
    """A decode request's target, for the router once the worker ran the allocating step."""

    router_url: str
    transfer_id: str
    target: RemoteTarget


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
    targets: list[Target] = field(default_factory=list)
    # Decode requests the sidecar never took (it refused or did not answer): the worker
    # reports them as failed loads so vLLM recomputes them instead of waiting forever.
    failed_recvs: list[str] = field(default_factory=list)
    pool_loads: list[PoolJob] = field(default_factory=list)
    pool_saves: list[PoolJob] = field(default_factory=list)
