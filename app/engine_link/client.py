"""The engine-side shim: what an inference worker calls, shaped after vLLM's connector hooks.

``register_kv_caches`` → ``add_send_request`` / ``expect_receive`` → per step ``begin_step`` and
``layer_ready(layer, event)`` → ``get_finished``. The engine and its sidecar are separate
processes; KV memory is shared as POSIX shared memory (CPU), so registering only sends names.
Calls are synchronous (vLLM workers are), each with a deadline; ``layer_ready`` is one-way and
never waits on the transfer path.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from app.devices import CpuEvent, Event
from app.engine_link.shm import ShmArena
from app.errors import KVSidecarError
from app.kvcache.engine_spec import EngineRegistration
from app.kvcache.groups import build_cache_config
from app.kvcache.layout import KVLayout, LayoutMode, RankLayout, allocate
from app.kvcache.presets import load_preset
from app.transfer.protocol import (
    AbortRequest,
    AddSend,
    AnyMsg,
    BeginStep,
    ExpectRecv,
    FailedRequest,
    Finished,
    GetFinished,
    LayerReady,
    Msg,
    PoolLoad,
    PoolLoaded,
    PoolLookup,
    PoolSave,
    RegisterCaches,
    RegisterEngine,
    RemoteTarget,
    Reply,
    SidecarInfo,
    StepSlice,
)
from app.transfer.sync_client import SyncClient


class EngineLinkError(KVSidecarError):
    """The sidecar refused or failed an engine call; the message is the sidecar's sentence."""


@dataclass(frozen=True)
class CacheParams:
    model: str
    tp_size: int
    block_size: int
    num_blocks: int
    layers: int | None = None
    dtype: str | None = None
    cache_dtype: str = "auto"
    layout_mode: str = "per_layer"
    kv_layout: str = "HND"
    heads_major: bool = False
    conv_layout: str = "SD"  # Mamba conv state rows: (state, dim) "SD" or (dim, state) "DS"


@dataclass(frozen=True)
class FinishedRequests:
    sending: list[str]
    recving: list[str]
    failed: list[FailedRequest]
    bytes: int = 0  # this rank's totals so far, for summaries
    descriptors: int = 0


class EngineLink:
    """One engine rank's connection to its sidecar."""

    def __init__(
        self,
        endpoint: str,
        engine_id: str,
        rank: int,
        *,
        timeout_s: float = 10.0,
        shm_prefix: str | None = None,
    ) -> None:
        self.client = SyncClient(endpoint)
        self.engine_id = engine_id
        self.rank = rank
        self.timeout_s = timeout_s
        self.arena = ShmArena(shm_prefix) if shm_prefix else ShmArena()
        self.epoch = ""
        self.control_port = 0

    def _call(self, msg: Msg, timeout: float | None = None) -> AnyMsg:
        reply = self.client.request(msg, timeout or self.timeout_s)
        if isinstance(reply, Reply) and not reply.ok:
            raise EngineLinkError(reply.error or "sidecar refused the call")
        if not isinstance(reply, Reply | Finished | PoolLoaded):
            raise EngineLinkError(
                f"unexpected reply {type(reply).__name__}: {getattr(reply, 'reason', '')}"
            )
        return reply

    def allocate_kv_caches(self, params: CacheParams) -> RankLayout:
        """Allocate this rank's KV cache in shared memory (as the worker's allocator would)."""
        model = load_preset(
            params.model,
            layers=params.layers,
            dtype=params.dtype,
            cache_dtype=params.cache_dtype,
            conv_layout=params.conv_layout,
        )
        config = build_cache_config(
            model, params.tp_size, params.block_size, num_blocks=params.num_blocks
        )
        return allocate(
            config,
            self.rank,
            mode=LayoutMode(params.layout_mode),
            kv_layout=KVLayout(params.kv_layout),
            heads_major=params.heads_major,
            allocator=self.arena.allocator,
        )

    def register_kv_caches(self, params: CacheParams, timeout_s: float = 60.0) -> None:
        reply = self._call(
            RegisterCaches(
                engine_id=self.engine_id,
                rank=self.rank,
                tp_size=params.tp_size,
                model=params.model,
                layers=params.layers,
                dtype=params.dtype,
                cache_dtype=params.cache_dtype,
                block_size=params.block_size,
                num_blocks=params.num_blocks,
                layout_mode=params.layout_mode,
                kv_layout=params.kv_layout,
                heads_major=params.heads_major,
                shm_names=list(self.arena.names),
                conv_layout=params.conv_layout,
            ),
            timeout_s,
        )
        assert isinstance(reply, Reply)
        self.epoch = str(reply.data.get("epoch", ""))
        self.control_port = int(reply.data.get("control_port") or 0)

    def register_engine(self, registration: EngineRegistration, timeout_s: float = 60.0) -> str:
        """Register KV memory the engine allocated itself; returns the compat hash."""
        reply = self._call(RegisterEngine(registration=registration), timeout_s)
        assert isinstance(reply, Reply)
        self.epoch = str(reply.data.get("epoch", ""))
        self.control_port = int(reply.data.get("control_port") or 0)
        return str(reply.data.get("compat_hash", ""))

    def sidecar_info(self) -> dict[str, str | int | float | bool | None]:
        """The sidecar's control address, epoch and readiness."""
        reply = self._call(SidecarInfo())
        assert isinstance(reply, Reply)
        return dict(reply.data)

    def add_send_request(
        self,
        request: str,
        prompt_len: int,
        block_ids: Sequence[np.ndarray],
        remote: RemoteTarget,
        *,
        mamba_mode: str = "none",
        num_spec: int = 0,
    ) -> None:
        self._call(
            AddSend(
                rank=self.rank,
                request=request,
                prompt_len=prompt_len,
                block_ids=[b.tolist() for b in block_ids],
                remote=remote,
                mamba_mode=mamba_mode,
                num_spec=num_spec,
            )
        )

    def expect_receive(
        self,
        request: str,
        prompt_len: int,
        block_ids: Sequence[np.ndarray],
        prefill_tp: int,
        *,
        timeout_s: float | None = None,
    ) -> None:
        self._call(
            ExpectRecv(
                rank=self.rank,
                request=request,
                prompt_len=prompt_len,
                block_ids=[b.tolist() for b in block_ids],
                prefill_tp=prefill_tp,
                timeout_s=timeout_s,
            )
        )

    def begin_step(
        self,
        step: int,
        slices: Sequence[tuple[str, int, int]],
        blocks: Mapping[str, Sequence[Sequence[int]]] | None = None,
    ) -> None:
        """Announce a step's token slices; ``blocks`` gives prefill block ids that grew."""
        grown = blocks or {}
        self._call(
            BeginStep(
                rank=self.rank,
                step=step,
                slices=[
                    StepSlice(r, s, e, [list(b) for b in grown[r]] if r in grown else None)
                    for r, s, e in slices
                ],
            )
        )

    def layer_ready(self, step: int, layer: int, event: Event | None = None) -> None:
        """Signal that ``layer``'s KV of ``step`` is written (after its reshape-cache event)."""
        del event  # the CPU event is complete; device events are waited on by the sidecar
        self.client.notify(LayerReady(rank=self.rank, step=step, layer=layer))

    def get_finished(self) -> FinishedRequests:
        reply = self._call(GetFinished(rank=self.rank))
        assert isinstance(reply, Finished)
        return FinishedRequests(
            reply.sending, reply.recving, reply.failed, reply.bytes, reply.descriptors
        )

    def pool_lookup(
        self, request: str, token_ids: Sequence[int], extra_keys: Sequence[str] = ()
    ) -> int:
        """Tokens of this prompt the KV pool can serve (vLLM's hybrid hit rule)."""
        reply = self._call(
            PoolLookup(
                rank=self.rank,
                request=request,
                token_ids=list(token_ids),
                extra_keys=list(extra_keys),
            )
        )
        assert isinstance(reply, Reply)
        return int(reply.data.get("hit_tokens") or 0)

    def pool_save(
        self,
        request: str,
        token_ids: Sequence[int],
        block_ids: Sequence[np.ndarray],
        num_computed: int,
        extra_keys: Sequence[str] = (),
    ) -> dict[str, int]:
        """Store fully computed blocks after prefill; the blocks may be freed on return."""
        reply = self._call(
            PoolSave(
                rank=self.rank,
                request=request,
                token_ids=list(token_ids),
                block_ids=[b.tolist() for b in block_ids],
                num_computed=num_computed,
                extra_keys=list(extra_keys),
            ),
            self.timeout_s * 3,
        )
        assert isinstance(reply, Reply)
        return {k: int(v or 0) for k, v in reply.data.items()}

    def pool_load(
        self,
        request: str,
        token_ids: Sequence[int],
        block_ids: Sequence[np.ndarray],
        hit_tokens: int,
        extra_keys: Sequence[str] = (),
    ) -> PoolLoaded:
        """Load a hit into ``block_ids``; ``failed_blocks`` must be recomputed."""
        reply = self._call(
            PoolLoad(
                rank=self.rank,
                request=request,
                token_ids=list(token_ids),
                block_ids=[b.tolist() for b in block_ids],
                hit_tokens=hit_tokens,
                extra_keys=list(extra_keys),
            ),
            self.timeout_s * 3,
        )
        assert isinstance(reply, PoolLoaded)
        return reply

    def abort(self, request: str, reason: str = "aborted by engine") -> None:
        self._call(AbortRequest(rank=self.rank, request=request, reason=reason))

    def close(self, unlink: bool = True) -> None:
        self.client.close()
        if unlink:
            self.arena.unlink()


__all__ = ["CacheParams", "CpuEvent", "EngineLink", "EngineLinkError", "FinishedRequests"]
