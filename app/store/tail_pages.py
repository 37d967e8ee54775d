"""A tail's pages as the pool stores them: the tail's own tokens, every other byte zero.

A tail is a request's last partial block (m tokens, m < block size). Its page in the engine
still holds, past slot m, whatever the block's previous owner wrote there: another request's KV,
perhaps another tenant's. Putting the page straight from engine memory would file those bytes in
shared storage under this request's name. So a tail's pages are copied into a staging slot with
only the bytes of token slots < m kept (every other byte, padding included, zero) and put from
there.

Which bytes are token ``t``'s comes from the layer's pieces (``app.kvcache.layout``): a piece
whose ``outer`` repeats number the kernel block's tokens holds token ``t`` in its ``t``-th
repeat (NHD, and vLLM CPU's HNC: a token row per head); a piece of one repeat holds all the
kernel block's tokens as consecutive rows inside each unit (HND's head, MLA's latent). A block
of ``ratio`` kernel blocks numbers its tokens kernel block by kernel block.

The staging slots are one registered arena per rank (RDMA reads only registered memory; over
TCP registering costs nothing), so their number bounds the tails being stored at once: a save
that finds no free slot stores no tail (counted by the caller). A slot is free again once the
put that reads it has returned, which for a put past its timeout is when Mooncake returns.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Sequence

import numpy as np

from app.errors import ConfigError
from app.kvcache.layout import LayerPlacement

STAGING_SLOTS = 4
"""Tails one rank stores at once; more wait for no one: they are not stored."""


def token_slots(pl: LayerPlacement, block_size: int, page: int) -> np.ndarray:
    """For every byte of one layer's page of a block: the token slot it belongs to, or
    ``block_size`` for bytes of no token (padding, other layers' bytes)."""
    kbs, rem = divmod(block_size, pl.ratio)
    if rem or kbs < 1:
        raise ConfigError(
            f"layer {pl.layer}: a block of {block_size} tokens is not {pl.ratio} kernel blocks"
        )
    slot = np.full(page, block_size, dtype=np.int32)
    rows = np.arange(kbs, dtype=np.int32)
    for k in range(pl.ratio):
        for pc in pl.pieces:
            for unit in range(pc.unit_count):
                start = k * pl.kernel_stride + pc.offset + unit * pc.unit_stride
                if pc.outer > 1:
                    if pc.outer != kbs:
                        raise ConfigError(
                            f"layer {pl.layer} piece {pc.name}: {pc.outer} repeats in a kernel "
                            f"block of {kbs} tokens: which bytes are a token's is unknown"
                        )
                    index = (
                        start
                        + rows[:, None] * pc.outer_stride
                        + np.arange(pc.unit_bytes, dtype=np.int64)[None, :]
                    )
                    tokens = np.broadcast_to(k * kbs + rows[:, None], index.shape)
                else:
                    row, rem = divmod(pc.unit_bytes, kbs)
                    if rem:
                        raise ConfigError(
                            f"layer {pl.layer} piece {pc.name}: {pc.unit_bytes} bytes are not "
                            f"{kbs} token rows"
                        )
                    index = start + np.arange(pc.unit_bytes, dtype=np.int64)
                    tokens = k * kbs + np.repeat(rows, row)
                if index.size and (index.min() < 0 or index.max() >= page):
                    raise ConfigError(
                        f"layer {pl.layer} piece {pc.name}: token bytes outside its page of "
                        f"{page} bytes"
                    )
                slot[index] = tokens
    return slot


class TailStaging:
    """Staging slots for one rank's tail pages: each slot holds one page of every layer."""

    def __init__(self, pages: dict[int, int], slot_maps: dict[int, np.ndarray]) -> None:
        self.layers = sorted(pages)
        self.offsets: dict[int, int] = {}
        at = 0
        for layer in self.layers:
            self.offsets[layer] = at
            at += pages[layer]
        self.slot_bytes = at
        self.pages = pages
        self.slot_maps = slot_maps
        self.arena = np.zeros(STAGING_SLOTS * max(at, 1), dtype=np.uint8)
        self._free = list(range(STAGING_SLOTS))
        self._lock = threading.Lock()

    def adopt(self, old: TailStaging) -> bool:
        """Take over ``old``'s arena and slots (already registered) if they are this one's
        size: a re-registered rank's new buffers, same model. False: not adopted."""
        if old.slot_bytes != self.slot_bytes:
            return False
        self.arena, self._free, self._lock = old.arena, old._free, old._lock
        return True

    @property
    def span(self) -> tuple[int, int]:
        """(address, bytes) of the arena, to register with the store."""
        return self.arena.ctypes.data, self.arena.nbytes

    def take(self) -> int | None:
        """A free slot, or None when every slot is in use."""
        with self._lock:
            return self._free.pop() if self._free else None

    def release(self, slot: int) -> None:
        """Free ``slot``; called from the store's thread when a late put returns."""
        with self._lock:
            self._free.append(slot)

    def stage(self, slot: int, layer: int, src: int, tokens: int) -> int:
        """Copy the page at address ``src`` (host memory) into ``slot``, keeping only token
        slots < ``tokens``; the staged page's address."""
        size = self.pages[layer]
        at = slot * self.slot_bytes + self.offsets[layer]
        dst = self.arena[at : at + size]
        page = np.ctypeslib.as_array(ctypes.cast(src, ctypes.POINTER(ctypes.c_uint8)), (size,))
        dst[:] = 0
        np.copyto(dst, page, where=self.slot_maps[layer] < tokens)
        return int(dst.ctypes.data)


def staging_for(
    placements: Sequence[LayerPlacement], block_sizes: dict[int, int], pages: dict[int, int]
) -> TailStaging:
    """A rank's staging slots (``block_sizes``: each layer's group's block size)."""
    maps: dict[tuple[object, ...], np.ndarray] = {}
    slot_maps = {}
    for pl in placements:
        # Layers of one geometry share one map (a 32-layer model has one or two).
        shape = (pl.pieces, pl.ratio, pl.kernel_stride, block_sizes[pl.layer], pages[pl.layer])
        if shape not in maps:
            maps[shape] = token_slots(pl, block_sizes[pl.layer], pages[pl.layer])
        slot_maps[pl.layer] = maps[shape]
    return TailStaging(pages, slot_maps)
