"""Blocks a request was just given, before anything of it was written there.

A KV pool tail stores its block's whole page: the tail's token slots and every slot past them.
vLLM hands a request blocks that still hold their previous owner's KV, and zeroes them only for
Mamba or mixed-precision caches (``needs_kv_cache_zeroing``). The slots past a tail would then
file another request's bytes under this request's name. Which bytes of a page are a token's
is the attention backend's business (vLLM's CPU kernels pack K their own way), so the worker
zeroes each fresh block's whole page before the step's forward pass and before any load or
push can land in it; a tail's page is then its tokens and zeros.

Fresh means "nothing of this request is there yet": a prefix-cache hit is a full block of
someone's computed KV and is never fresh, and a block an async load fills is fresh when it is
allocated, not when the request is scheduled after the load.
"""

from __future__ import annotations

from typing import Any

import torch

from app.connectors.vllm.metadata import BlockIds
from app.kvcache.engine_spec import EngineRegistration

# The groups whose pages a tail can hold (the pool takes tails only where every group is one).
TAIL_KINDS = frozenset({"full", "mla"})


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class FreshBlocks:
    """Collects, step by step, the fresh blocks of every attention group (one list a group)."""

    def __init__(self, block_sizes: list[int]) -> None:
        self.block_sizes = block_sizes
        self._hits: dict[str, int] = {}  # the engine's own prefix hit, until allocation
        self._fresh: BlockIds = [[] for _ in block_sizes]

    def hit(self, rid: str, num_computed: int) -> None:
        """vLLM's own prefix hit for a waiting request (``get_num_new_matched_tokens``)."""
        self._hits[rid] = num_computed

    def allocated(self, rid: str, ids: BlockIds, num_external: int) -> None:
        """An async load's blocks (``update_state_after_alloc``): fresh past the engine's own
        hit. The request is scheduled only after the load, when the loaded blocks are no
        longer fresh; a request without a load is taken in ``scheduled``."""
        hit = self._hits.pop(rid, 0)
        if num_external > 0:
            self._add(ids, [hit // size for size in self.block_sizes])

    def scheduled(self, out: Any) -> None:
        """The step's ``SchedulerOutput``: new requests past what is computed (a hit, or a
        load that has landed, whose last block may be partly filled), running requests'
        new blocks (a resumed one lists its whole table)."""
        for new in out.scheduled_new_reqs:
            self._hits.pop(new.req_id, None)
            self._past(new.block_ids, new.num_computed_tokens)
        cached = out.scheduled_cached_reqs
        resumed = cached.resumed_req_ids
        for i, rid in enumerate(cached.req_ids):
            grown = cached.new_block_ids[i]
            if not grown:
                continue
            if rid in resumed:
                self._past(grown, cached.num_computed_tokens[i])
            else:
                self._add(grown, [0] * len(self.block_sizes))

    def forget(self, rid: str) -> None:
        self._hits.pop(rid, None)

    def take(self) -> BlockIds:
        fresh, self._fresh = self._fresh, [[] for _ in self.block_sizes]
        return fresh

    def _past(self, ids: Any, computed: int) -> None:
        self._add(ids, [_ceil_div(computed, size) for size in self.block_sizes])

    def _add(self, ids: Any, starts: list[int]) -> None:
        for g, (group, start) in enumerate(zip(ids, starts, strict=True)):
            self._fresh[g].extend(int(b) for b in list(group)[start:])


def attention_views(
    reg: EngineRegistration, kv_caches: dict[str, torch.Tensor]
) -> dict[int, list[tuple[torch.Tensor, int]]]:
    """Per attention group, each layer's registered view with its kernel blocks per block."""
    views: dict[int, list[tuple[torch.Tensor, int]]] = {}
    for layer in reg.layers:
        group = reg.groups[layer.group]
        if group.kind in TAIL_KINDS:
            ratio = group.block_size // group.kernel_block_size
            views.setdefault(layer.group, []).append((kv_caches[layer.name], ratio))
    return views


def zero_blocks(
    views: dict[int, list[tuple[torch.Tensor, int]]], fresh: BlockIds, null_block: int = 0
) -> None:
    """Zero the whole pages of ``fresh[g]``'s blocks in every layer of group ``g``."""
    for g, ids in enumerate(fresh):
        blocks = [b for b in ids if b != null_block]
        for view, ratio in views.get(g, ()) if blocks else ():
            rows = torch.tensor(
                [b * ratio + k for b in blocks for k in range(ratio)], device=view.device
            )
            view.index_fill_(0, rows, 0)
