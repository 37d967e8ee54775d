"""One engine rank's view of the KV pool: its keys, its coordinator and its pages.

A rank stores its own shard under a namespace that ranks holding identical bytes share (see
``keys.tp_namespace``); its keys name the checkpoint it registered (``from_engine``), and its
coordinator follows vLLM's hybrid hit rules with the engine's own speculative settings.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Literal

from app.errors import ConfigError
from app.kvcache.desc import LayoutDesc
from app.kvcache.digest import HostMemory, KvMemory
from app.kvcache.engine_spec import EngineRegistration
from app.kvcache.layout import LayerPlacement
from app.kvcache.specs import RegionKind
from app.store.coordinator import PoolCoordinator, PoolGroup
from app.store.hashing import (
    KeyRun,
    expand_key_runs,
    group_block_hashes,
    hash_blocks,
    root_hash,
    tail_hashes,
)
from app.store.keys import KeyPrefix, block_keys, tp_namespace

_NS_KIND: dict[RegionKind, Literal["split", "replicate", "state"]] = {
    RegionKind.SPLIT: "split",
    RegionKind.REPLICATE: "replicate",
    RegionKind.STATE: "state",
}


class RankPool:
    """Keys, coordinator and page addresses of one engine rank's cache."""

    def __init__(
        self,
        desc: LayoutDesc,
        prefixes: dict[int, KeyPrefix],
        page_bytes: dict[int, int],
        spans: list[tuple[int, int]],
        *,
        eagle_groups: Sequence[int] = (),
        speculative: bool = False,
        served_models: Sequence[str] = (),
        memory: KvMemory | None = None,
    ) -> None:
        self.desc = desc
        # The pages as the pool's digests read them: numpy over the mapped pages unless the
        # caller passes the engine's device tensors.
        self.memory: KvMemory = memory if memory is not None else HostMemory(tuple(spans))
        self.served_models = tuple(served_models)
        self.prefixes = prefixes
        self.page_bytes = page_bytes
        self.spans = spans
        # EAGLE/MTP: vLLM drops the last matched block of these groups; with any speculative
        # decoding no tails (a hit inside a block is not what vLLM's cache would take).
        self.speculative = speculative
        self.coordinator = PoolCoordinator(
            [
                PoolGroup(g.kind.value, g.block_size, sliding_window=g.sliding_window)
                for g in desc.groups
            ],
            use_eagle=bool(eagle_groups),
            eagle_group_ids=list(eagle_groups) or None,
        )

    @classmethod
    def from_engine(
        cls,
        desc: LayoutDesc,
        reg: EngineRegistration,
        spans: list[tuple[int, int]],
        namespace: str = "",
        *,
        memory: KvMemory | None = None,
    ) -> RankPool:
        """A rank registered by a real engine: pages, dtypes and heads are the engine's own.

        The key's model part names the architecture (``model_type``, the compat hash over the
        layer facts), the checkpoint the engine registered (weights, revision, KV dtypes) and the
        operator's ``namespace``: KV computed by other weights is never another's hit.

        A layer's page of a block is its block stride (vLLM gives every layer its own
        block-major tensor; hybrid pages are padded alike), so a stored page is what the
        engine holds for that block, padding included; in a cross-layer block it is the
        block's share of one slot.
        """
        layout_name = f"engine.{desc.kv_layout}.bs{max(g.block_size for g in desc.groups)}"
        prefixes: dict[int, KeyPrefix] = {}
        kinds = {layer: r.kind for r in desc.regions for layer in r.layers}
        identity = "\0".join((desc.compat_hash, reg.checkpoint, namespace))
        model = f"{reg.model}.{hashlib.sha256(identity.encode()).hexdigest()[:12]}"
        for pl in desc.placements:
            layer = reg.layers[pl.layer]
            ns = tp_namespace(
                _NS_KIND[kinds[pl.layer]],
                tp_size=desc.tp,
                rank=desc.rank,
                num_kv_heads=layer.total_heads or None,
            )
            prefixes[pl.layer] = KeyPrefix(model, layer.dtype, layout_name, ns)
        return cls(
            desc,
            prefixes,
            _pages(desc.placements),
            spans,
            eagle_groups=reg.eagle_groups,
            speculative=bool(reg.speculative),
            served_models=reg.served_models,
            memory=memory,
        )

    def group_hashes(
        self, token_ids: Sequence[int], extra_keys: Sequence[KeyRun]
    ) -> list[list[bytes]]:
        """Per group, the names of the full blocks of ``token_ids``; ``extra_keys``: vLLM's
        extra keys of each hash block, as runs (``hashing.expand_key_runs``)."""
        bs = self.coordinator.hash_block_size
        keys = expand_key_runs(extra_keys, len(token_ids) // bs)
        fine = hash_blocks(list(token_ids), bs, block_keys=keys)
        return group_block_hashes(fine, bs, [g.block_size for g in self.desc.groups])

    def keys(
        self, hashes: list[list[bytes]], group: int, blocks: Sequence[int]
    ) -> list[tuple[int, int, str]]:
        """(layer, block index, key) for ``blocks`` of ``group`` in every layer of it."""
        out: list[tuple[int, int, str]] = []
        for layer in self.desc.groups[group].layers:
            keys = block_keys(self.prefixes[layer], layer, [hashes[group][b] for b in blocks])
            out.extend((layer, b, k) for b, k in zip(blocks, keys, strict=True))
        return out

    def tail_names(
        self,
        hashes: list[list[bytes]],
        token_ids: Sequence[int],
        start: int,
        end: int,
        extra_keys: Sequence[KeyRun],
    ) -> list[bytes]:
        """The names of the tails ``token_ids[start:start + m]``, m = 1 .. ``end - start``
        (``start`` on a block boundary, the full blocks before it named by ``hashes``): every
        group shares one block size here. A tail carries the extra keys of the block it begins."""
        bs = self.coordinator.lcm_block_size
        block = start // bs
        parent = hashes[0][block - 1] if block else root_hash()
        keys = expand_key_runs(extra_keys, block + 1)[block]
        return tail_hashes(bs, parent, token_ids[start:end], keys)

    def tail_keys(self, group: int, names: Sequence[bytes]) -> list[tuple[int, str]]:
        """(layer, key) of every tail in ``names`` in every layer of ``group``, layer by
        layer."""
        return [
            (layer, key)
            for layer in self.desc.groups[group].layers
            for key in block_keys(self.prefixes[layer], layer, names)
        ]

    def page(self, layer: int, block_id: int) -> tuple[int, int]:
        """(address, bytes) of one layer's page of a manager block."""
        pl = self.desc.placement(layer)
        return (pl.base + block_id * pl.block_stride, self.page_bytes[layer])


def _pages(placements: Sequence[LayerPlacement]) -> dict[int, int]:
    """Each layer's page: its block stride, or the stride over the slots that share it when
    several layers' pages are interleaved in one block (cross-layer)."""
    bases: dict[tuple[int, int], set[int]] = {}
    for pl in placements:
        bases.setdefault((pl.buffer, pl.block_stride), set()).add(pl.base)
    pages = {}
    for pl in placements:
        own = bases[(pl.buffer, pl.block_stride)]
        interleaved = max(own) - min(own) < pl.block_stride
        page = pl.block_stride // len(own) if interleaved else pl.block_stride
        end = (pl.ratio - 1) * pl.kernel_stride + max(
            (
                pc.offset
                + (pc.outer - 1) * pc.outer_stride
                + (pc.unit_count - 1) * pc.unit_stride
                + pc.unit_bytes
                for pc in pl.pieces
            ),
            default=0,
        )
        if end > page:
            raise ConfigError(
                f"layer {pl.layer}'s KV of a block is not one contiguous page (heads-major "
                "cross-layer blocks?); the KV pool needs per_layer or cross_layer"
            )
        pages[pl.layer] = page
    return pages
