"""A simulated engine rank's KV cache: a preset allocated as the engine's own memory.

The one place where a preset becomes a cache config and an allocation (the engine, the cluster
driver's post-mortem mapping and the bench plans all come here). The rank registers what it
allocated as a vLLM worker does: ``RegisterEngine`` with ``preset_registration``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from app.devices.events import DEFAULT_SLOTS
from app.devices.memory import DeviceArena
from app.devices.shm import ShmArena
from app.engine_link.client import EngineLink
from app.kvcache.engine_spec import EngineRegistration, MemorySpan
from app.kvcache.groups import CacheConfig, build_cache_config
from app.kvcache.layout import KVLayout, LayoutMode, RankLayout, allocate, zeros_allocator
from app.kvcache.preset_registration import preset_registration
from app.kvcache.presets import load_preset


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
    # An event ring with this many slots per layer (app.devices.events); off: every layer is
    # complete when signalled, or waited for in this process (``EngineLink.layer_ready``).
    events: bool = False
    event_slots: int = DEFAULT_SLOTS
    device: str = "cpu"  # where the KV lives: cpu (POSIX shm), cuda[:i] or npu[:i]


def preset_config(params: CacheParams) -> CacheConfig:
    """Groups, slots and sizes of ``params``' preset at its TP size."""
    model = load_preset(
        params.model,
        layers=params.layers,
        dtype=params.dtype,
        cache_dtype=params.cache_dtype,
        conv_layout=params.conv_layout,
    )
    return build_cache_config(
        model, params.tp_size, params.block_size, num_blocks=params.num_blocks
    )


def allocate_rank(
    params: CacheParams,
    rank: int,
    *,
    allocator: Callable[[int], torch.Tensor] = zeros_allocator,
    config: CacheConfig | None = None,
) -> RankLayout:
    """Rank ``rank``'s KV cache with ``params``' layout, its buffers from ``allocator``."""
    return allocate(
        config or preset_config(params),
        rank,
        mode=LayoutMode(params.layout_mode),
        kv_layout=KVLayout(params.kv_layout),
        heads_major=params.heads_major,
        allocator=allocator,
    )


@dataclass(frozen=True)
class SimKV:
    """One rank's KV memory, owned by the engine: POSIX shm segments or device buffers."""

    layout: RankLayout
    shm: ShmArena
    device: DeviceArena | None = None

    @classmethod
    def allocate(cls, params: CacheParams, rank: int, shm_prefix: str | None = None) -> SimKV:
        """Allocate in shared memory, or on ``params.device`` to be exported at registration."""
        shm = ShmArena(shm_prefix) if shm_prefix else ShmArena()
        device = DeviceArena(params.device) if params.device != "cpu" else None
        allocator = device.allocator if device is not None else shm.allocator
        return cls(allocate_rank(params, rank, allocator=allocator), shm, device)

    def registration(self, engine_id: str, link: EngineLink | None = None) -> EngineRegistration:
        """What this rank registers; with ``link``, its current event ring too."""
        buffers = self.layout.buffers
        device_memory = self.device.export() if self.device is not None else None
        if device_memory is not None:
            assert self.device is not None
            memory = [
                MemorySpan(f"{self.device.device}-{i}", 0, b.numel()) for i, b in enumerate(buffers)
            ]
        else:
            memory = [
                MemorySpan(n, 0, b.numel()) for n, b in zip(self.shm.names, buffers, strict=True)
            ]
        ring = link.ring if link is not None else None
        return preset_registration(
            self.layout,
            engine_id=engine_id,
            memory=memory,
            events=ring.spec if ring is not None else None,
            device_memory=device_memory,
        )

    def close(self, unlink: bool = True) -> None:
        """Stop exporting device buffers; ``unlink``: remove the shm names (mappings stay)."""
        if self.device is not None:
            self.device.close()
        if unlink:
            self.shm.unlink()


def register_rank(link: EngineLink, params: CacheParams, timeout_s: float = 60.0) -> SimKV:
    """Allocate ``link``'s rank and register it (with a new event ring if ``params.events``)."""
    kv = SimKV.allocate(params, link.rank, link.shm_prefix)
    try:
        if params.events:
            link.create_event_ring(len(kv.layout.placements), params.device, params.event_slots)
        link.register_engine(kv.registration(link.engine_id, link), timeout_s)
    except BaseException:
        kv.close()
        raise
    return kv
