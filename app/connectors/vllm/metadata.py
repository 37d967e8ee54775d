"""What the scheduler side tells the worker side each step (vLLM connector metadata).

The sidecar's own wire messages (``AddSend``, ``ExpectRecv``, ``StepSlice``) travel in it, so
the worker forwards them as they are: one representation of block ids from the scheduler to
the sidecar."""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from app.connectors.params import KV_DIGEST_MISMATCH
from app.connectors.vllm.config import DEFAULT_TARGET_TIMEOUT_S
from app.store.hashing import KeyRun
from app.transfer.wire.protocol import AddSend, ExpectRecv, RemoteTarget, StepSlice

BlockIds = list[list[int]]


@dataclass(frozen=True)
class Admit:
    """A prefill request to admit at the sidecar: ``send`` is the message each worker gives
    its rank's sidecar (its ``rank`` set there; ``send.request`` is the id both sidecars use).

    Without ``send.remote`` each worker fetches decode's target from ``router_url``
    (concurrent dispatch, waiting at most ``fetch_timeout_s``) and hands it to its sidecar
    rank, or, without a router either (prefill first), decode posts it to the sidecar, which
    keeps the send at most ``send.target_timeout_s``."""

    req_id: str
    send: AddSend
    router_url: str | None = None
    fetch_timeout_s: float = DEFAULT_TARGET_TIMEOUT_S
    token: str | None = None  # the transfer's capability at the router
    # Decode first under pipeline parallel: decode's target per stage; each worker sends to
    # its own stage's (``send.remote`` is stage 0's).
    stage_remotes: tuple[RemoteTarget, ...] = ()

    def for_stage(self, rank: int, stage: int) -> AddSend:
        """The send as pipeline stage ``stage``'s rank ``rank`` gives it to its sidecar."""
        remote = self.stage_remotes[stage] if self.stage_remotes else self.send.remote
        return msgspec.structs.replace(self.send, rank=rank, remote=remote)


@dataclass(frozen=True)
class Expect:
    """A decode request every worker's sidecar rank expects (``recv``, its ``rank`` set
    there); rank 0 then posts its target to ``router_url``."""

    req_id: str
    recv: ExpectRecv
    computed: int  # prompt tokens decode's own prefix cache holds: prefill skips them
    router_url: str | None
    token: str | None = None  # the transfer's capability at the router


@dataclass(frozen=True)
class PoolJob:
    """Load ``tokens`` pool-hit tokens into, or store the first ``tokens`` tokens from, a
    request's blocks (per group). ``held``: tokens of a load the engine's own prefix cache
    already put in place (never fetched again); ``key_runs``: what besides the tokens names
    each block (vLLM's own extra keys, ``pool_keys.key_runs``), as in its block hashes.

    A store while the request runs (``running``) goes by ``req_id`` = its own save id: it ends
    through ``PoolSavesDone``, not ``finished_sending`` (which frees a request's blocks);
    ``stored``: tokens the request's earlier stores stored (no block ending at or before them
    is sent again)."""

    req_id: str
    token_ids: list[int]
    block_ids: BlockIds
    tokens: int
    held: int = 0
    key_runs: list[KeyRun] = field(default_factory=list)
    stored: int = 0
    running: bool = False


@dataclass(frozen=True)
class PoolSavesDone(KVConnectorWorkerMetadata):
    """What a worker reports with a step's output: the running requests' stores it saw end
    (save id -> workers; the scheduler releases a store's blocks once every worker has
    reported it), and why loads it failed in this step failed (vLLM request id -> one of
    ``params.KV_LOAD_ERRORS``; vLLM's ``failed_recving`` names the requests, not why)."""

    saves: dict[str, int]
    load_errors: dict[str, str] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, PoolSavesDone)
        merged = dict(self.saves)
        for sid, n in other.saves.items():
            merged[sid] = merged.get(sid, 0) + n
        # A digest mismatch on any rank is the reason: it says more than another's failure.
        errors = dict(self.load_errors)
        for rid, why in other.load_errors.items():
            if errors.get(rid) != KV_DIGEST_MISMATCH:
                errors[rid] = why
        return PoolSavesDone(merged, errors)


@dataclass
class KVSidecarMetadata(KVConnectorMetadata):
    admits: list[Admit] = field(default_factory=list)
    slices: list[StepSlice] = field(default_factory=list)
    expects: list[Expect] = field(default_factory=list)
    pool_loads: list[PoolJob] = field(default_factory=list)
    pool_saves: list[PoolJob] = field(default_factory=list)
    # The step runs a forward pass (vLLM's no-forward steps only exchange transfer results).
    forward: bool = True
    # Why requests first seen this step go without the KV pool or a transfer, one entry each
    # (pool_keys.SKIP_*): rank 0 counts them in vLLM's stats.
    skipped: list[str] = field(default_factory=list)
    # Per group, blocks given to requests this step that nothing was written to yet: zeroed
    # before the forward pass where the pool stores tails (fresh_blocks).
    fresh: BlockIds = field(default_factory=list)
