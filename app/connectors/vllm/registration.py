"""The engine's KV cache as it is: read off vLLM's ``kv_cache_config`` and its tensors.

On CPU the KV storage is moved into shared memory in place (``share_memory_``: views and the
engine's kernels keep working on the same storage object) and the sidecar maps the same file.
Nothing here consults a preset: groups, block sizes, shapes and strides are vLLM's.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from math import prod
from typing import Any

import msgspec
import torch
import torch.multiprocessing as mp
from vllm.model_executor.models.utils import extract_layer_index
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)

from app.connectors.vllm.checkpoint import checkpoint_identity
from app.connectors.vllm.speculative import (
    draft_kv_heads,
    draft_layers,
    eagle_groups,
    speculative_identity,
)
from app.devices import Device
from app.devices.memory import Exported, export_buffer
from app.devices.shm import SHM_DIR
from app.devices.spec import DeviceBuffer
from app.errors import ConfigError
from app.kvcache.engine_spec import (
    Axis,
    EngineGroup,
    EngineLayer,
    EngineRegistration,
    MemorySpan,
    StatePart,
    StateTensor,
)

log = logging.getLogger(__name__)

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


def layer_spec(spec: Any, name: str) -> Any:
    """The spec of one layer of a group: vLLM merges same-type layers of different shapes
    (a drafter with other KV heads or head size than its target) into one
    ``UniformTypeKVCacheSpecs`` group that keeps each layer's own spec."""
    return spec.kv_cache_specs[name] if isinstance(spec, UniformTypeKVCacheSpecs) else spec


def _group(spec: Any, layers: list[str], kernel: int) -> EngineGroup:
    if isinstance(spec, UniformTypeKVCacheSpecs):
        kinds = {
            (type(s), getattr(s, "sliding_window", None)) for s in spec.kv_cache_specs.values()
        }
        if len(kinds) != 1:
            raise ConfigError(
                f"KV cache group of {layers[0]}.. mixes layer specs {sorted(map(str, kinds))}"
            )
        spec = spec.first_spec
    if isinstance(spec, MLAAttentionSpec):
        return EngineGroup("mla", spec.block_size, kernel, layers)
    if isinstance(spec, SlidingWindowSpec):
        return EngineGroup("sliding", spec.block_size, kernel, layers, spec.sliding_window)
    if isinstance(spec, FullAttentionSpec) and getattr(spec, "attention_chunk_size", None) is None:
        return EngineGroup("full", spec.block_size, kernel, layers)
    if isinstance(spec, MambaSpec):
        return EngineGroup(
            "mamba",
            spec.block_size,
            spec.block_size,
            layers,
            mamba_mode=str(spec.mamba_cache_mode),
            num_spec=int(spec.num_speculative_blocks),
        )
    raise ConfigError(
        f"KV cache group of {layers[0]}.. has spec {type(spec).__name__}, which the sidecar "
        "cannot move; supported: full attention, sliding window, MLA, Mamba1/Mamba2/GDN state"
    )


def _conv_parts(spec: Any, conv_dim: int, ssm_shape: tuple[int, ...], tp: int) -> list[StatePart]:
    """The conv state's sub-projections along its dim axis, in global columns.

    vLLM shards each sub-projection evenly over TP, so a column is a TP-independent unit. The
    split follows vLLM's documented conv layouts: Mamba1 ``x``; Mamba2 ``x | B | C`` with
    ``x`` = heads x head_dim of the ssm state and ``B == C``; GDN ``q | k | v`` with ``v`` =
    value heads x value head dim of the ssm state and ``q == k``.
    """
    kind = str(getattr(spec.mamba_type, "name", spec.mamba_type)).upper()
    if "MAMBA1" in kind:
        return [StatePart("x", conv_dim * tp, 1)]
    if "MAMBA2" in kind:
        x = ssm_shape[0] * ssm_shape[1]
        b = (conv_dim - x) // 2
        if b <= 0 or x + 2 * b != conv_dim:
            raise ConfigError(f"Mamba2 conv dim {conv_dim} does not split into x={x} + 2 B/C")
        return [StatePart("x", x * tp, 1), StatePart("B", b * tp, 1), StatePart("C", b * tp, 1)]
    if "GDN" in kind:
        v = ssm_shape[0] * ssm_shape[1]
        k = (conv_dim - v) // 2
        if k <= 0 or v + 2 * k != conv_dim:
            raise ConfigError(f"GDN conv dim {conv_dim} does not split into 2 q/k + v={v}")
        return [StatePart("q", k * tp, 1), StatePart("k", k * tp, 1), StatePart("v", v * tp, 1)]
    raise ConfigError(
        f"Mamba-style type {kind} is not supported by the sidecar; supported: Mamba1, Mamba2, GDN"
    )


def _state_layer(
    name: str, gi: int, buffer: int, raw: torch.Tensor, views: Any, spec: Any, tp: int
) -> EngineLayer:
    """A state layer from the views vLLM bound to the layer (conv first, then temporal)."""
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

    views = list(views) if isinstance(views, list | tuple) else [views]
    if len(views) != 2:
        raise ConfigError(f"layer {name}: expected conv and temporal state views, got {len(views)}")
    conv, ssm = views
    for v in views:
        inner = v.contiguous().stride()[1:]
        if v.stride()[1:] != inner:
            raise ConfigError(f"layer {name}: a state view is not contiguous inside its block")
    dim_first = bool(is_conv_state_dim_first())
    conv_dim = int(conv.shape[1] if dim_first else conv.shape[2])
    ssm_shape = tuple(int(x) for x in ssm.shape[1:])
    states = [
        StateTensor(
            "conv",
            _dtype(conv.dtype),
            conv.data_ptr() - raw.data_ptr(),
            [int(x) for x in conv.shape[1:]],
            True,
            dim_first,
            _conv_parts(spec, conv_dim, ssm_shape, tp),
        ),
        StateTensor(
            "ssm",
            _dtype(ssm.dtype),
            ssm.data_ptr() - raw.data_ptr(),
            list(ssm_shape),
            False,
            False,
            [StatePart("heads", ssm_shape[0] * tp, prod(ssm_shape[1:]))],
        ),
    ]
    return EngineLayer(
        name=name,
        group=gi,
        buffer=buffer,
        offset=0,
        dtype="uint8",
        block_stride=int(conv.stride(0)) * conv.dtype.itemsize,
        states=states,
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


def unlink_spans(spans: list[MemorySpan]) -> None:
    """Remove the /dev/shm names of registered KV memory (the mappings stay valid)."""
    for span in spans:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(SHM_DIR, span.name))


def kv_device(kv_caches: dict[str, torch.Tensor]) -> Device:
    """The device every KV tensor lives on (they must agree)."""
    devices = {t.device for t in kv_caches.values()}
    if len(devices) != 1:
        raise ConfigError(f"KV tensors on several devices {sorted(map(str, devices))}")
    dev = devices.pop()
    return Device(dev.type, dev.index or 0)


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
    exported: list[Exported] | None = None,
    with_draft: bool = True,
) -> EngineRegistration:
    """The registration of one worker's KV cache; shares the storages as a side effect (CPU:
    /dev/shm files; CUDA/NPU: IPC handles, whose keep-alives go into ``exported``).

    ``with_draft`` False leaves a speculative drafter's layers out (they are not moved)."""
    exported = exported if exported is not None else []
    model_config = vllm_config.model_config
    num_blocks = int(kv_cache_config.num_blocks)
    every = [n for g in kv_cache_config.kv_cache_groups for n in g.layer_names]
    drafts = draft_layers(every, vllm_config)
    left_out = frozenset() if with_draft else drafts
    for g in kv_cache_config.kv_cache_groups:
        if left_out and set(g.layer_names) <= left_out:
            raise ConfigError(
                f"the draft's layers {list(g.layer_names)[:2]}.. form a KV cache group of their "
                "own; they cannot be left out of the transfer (transfer_draft_kv false needs a "
                "draft that shares the target's group)"
            )
    names = layer_order([n for n in every if n not in left_out])
    missing = [n for n in names if n not in kv_caches]
    if missing:
        raise ConfigError(f"vLLM gave no KV tensor for layers {missing[:4]}")
    on_device = kv_device(kv_caches).kind != "cpu"
    spans: dict[int, int] = {}
    memory: list[MemorySpan] = []
    device_memory: list[DeviceBuffer] = []
    groups: list[EngineGroup] = []
    layers: dict[str, EngineLayer] = {}
    total_heads = int(model_config.get_total_num_kv_heads())
    # A drafter with a config of its own (draft_model, EAGLE) may have other KV heads.
    draft_heads = draft_kv_heads(vllm_config) or total_heads
    forward_context = vllm_config.compilation_config.static_forward_context
    for gi, g in enumerate(kv_cache_config.kv_cache_groups):
        spec: Any = g.kv_cache_spec
        # A state page is one block: it has no token axis to split into kernel blocks.
        kernels = (
            {int(spec.block_size)}
            if isinstance(layer_spec(spec, g.layer_names[0]), MambaSpec)
            else {int(kv_caches[n].shape[2]) for n in g.layer_names}
        )
        if len(kernels) != 1:
            raise ConfigError(f"group {gi} mixes kernel block sizes {sorted(kernels)}")
        kernel = kernels.pop()
        kept = [n for n in g.layer_names if n not in left_out]
        groups.append(_group(spec, kept, kernel))
        for name in kept:
            own = layer_spec(spec, name)
            t = kv_caches[name]
            if t.dim() != 4 or t.shape[0] != num_blocks * (spec.block_size // kernel):
                raise ConfigError(
                    f"layer {name}: expected a [blocks, heads, tokens, channels] view with "
                    f"{num_blocks} x {spec.block_size // kernel} kernel blocks, got "
                    f"{tuple(t.shape)}; this vLLM version's layout is not supported"
                )
            storage = t.untyped_storage()
            if not on_device and not storage.is_shared():
                # Sharing moves the bytes, so key storages by their address afterwards.
                _share(storage)
            key = storage.data_ptr()
            if key not in spans:
                if on_device:
                    device_memory.append(_export(storage, exported))
                    memory.append(MemorySpan(f"{t.device}-{len(memory)}", 0, storage.nbytes()))
                else:
                    memory.append(shared_span(storage))
                spans[key] = len(memory) - 1
            buffer = spans[key]
            if isinstance(own, MambaSpec):
                layer = _state_layer(
                    name, gi, buffer, t, forward_context[name].kv_cache, own, tp_size
                )
                layers[name] = msgspec.structs.replace(
                    layer, offset=t.data_ptr() - storage.data_ptr()
                )
                continue
            mla = isinstance(own, MLAAttentionSpec)
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
                head_size=int(own.head_size),
                head_size_v=0 if mla else int(own.head_size_v),
                total_heads=1 if mla else (draft_heads if name in drafts else total_heads),
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
        device_memory=device_memory if on_device else None,
        speculative=speculative_identity(vllm_config),
        checkpoint=checkpoint_identity(vllm_config),
        served_models=served_models(model_config),
        eagle_groups=eagle_groups(vllm_config, kv_cache_config),
    )


def served_models(model_config: Any) -> list[str]:
    """The names the OpenAI server answers for the base model (vLLM's served_model_name, else
    the model itself)."""
    names = model_config.served_model_name or model_config.model
    return [str(n) for n in ([names] if isinstance(names, str) else names)][:16]


def _export(storage: torch.UntypedStorage, exported: list[Exported]) -> DeviceBuffer:
    """A device storage shared with the sidecar (CUDA/NPU IPC, or cuMem descriptors whose
    server ``exported`` keeps open while the engine runs)."""
    whole = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
    out = export_buffer(whole)
    exported.append(out)
    return out.buffer


def _vllm_version() -> str:
    import vllm

    return str(vllm.__version__)


# torch's shared-memory manager must answer each new file within 1 s (libshm's poll); on two
# busy cores, an engine compiling its graphs beside this one, it did not (measured once in a
# PP 2 pair: "Shared memory manager connection has timed out" at registration). Nothing is
# allocated before that answer, so another try is safe.
_SHARE_TRIES = 5


def _share(storage: Any) -> None:
    """Move ``storage`` into a named shared-memory file (the sidecar maps it by that name)."""
    mp.set_sharing_strategy("file_system")
    for attempt in range(1, _SHARE_TRIES + 1):
        try:
            storage.share_memory_()
            return
        except RuntimeError as e:
            if "Shared memory manager" not in str(e) or attempt == _SHARE_TRIES:
                raise
            log.warning("sharing the KV cache with the sidecar, try %d: %s; again", attempt, e)
            time.sleep(0.5)
