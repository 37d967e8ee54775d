"""Allocation: zero-copy views, regions, cross-layer and heads-major placement."""

from __future__ import annotations

import pytest
import torch

from app.errors import ConfigError
from app.kvcache.groups import build_cache_config
from app.kvcache.layout import KVLayout, LayoutMode, allocate
from app.kvcache.preset_registration import describe
from app.kvcache.presets import load_preset


def _layout(
    model: str,
    tp: int = 2,
    rank: int = 0,
    *,
    layers: int = 4,
    block: int = 16,
    mode: LayoutMode = LayoutMode.PER_LAYER,
    kv: KVLayout = KVLayout.HND,
    heads_major: bool = False,
):  # type: ignore[no-untyped-def]
    cfg = build_cache_config(load_preset(model, layers=layers), tp, block, num_blocks=8)
    return allocate(cfg, rank, mode=mode, kv_layout=kv, heads_major=heads_major)


def _inside(view: torch.Tensor, bufs: list[torch.Tensor]) -> bool:
    return any(b.data_ptr() <= view.data_ptr() < b.data_ptr() + b.numel() for b in bufs)


@pytest.mark.parametrize("mode", list(LayoutMode))
def test_views_are_zero_copy(mode: LayoutMode) -> None:
    lay = _layout("qwen3-next-80b-a3b", mode=mode)
    for views in lay.views.values():
        for v in views.values():
            assert _inside(v, lay.buffers)
    # A write through a view is visible in the buffer, at the block's address.
    k = lay.views[3]["k"]
    k[5].fill_(1.0)
    pl = lay.placements[3]
    buf = lay.buffers[pl.buffer]
    off = pl.base - buf.data_ptr() + 5 * pl.block_stride
    assert bool(buf[off : off + k[5].numel() * 2].any())
    assert not bool(buf[: pl.base - buf.data_ptr() + 4 * pl.block_stride].any())


def test_attention_view_shapes() -> None:
    hnd = _layout("llama-3.1-8b", tp=2)
    assert tuple(hnd.views[0]["k"].shape) == (8, 1, 4, 16, 128)
    nhd = _layout("llama-3.1-8b", tp=2, kv=KVLayout.NHD)
    assert tuple(nhd.views[0]["v"].shape) == (8, 1, 16, 4, 128)


def test_per_layer_regions_one_per_tensor_and_group() -> None:
    lay = _layout("gpt-oss-20b", layers=4)
    regions = lay.regions()
    # Two slots, each shared by a sliding and a full layer: four regions on two bases.
    assert len(regions) == 4
    assert len({r.base for r in regions}) == 2
    assert len({(r.base, r.block_stride, r.group) for r in regions}) == 4


def test_cross_layer_one_buffer_per_page_size() -> None:
    lay = _layout("deepseek-v3.2-exp", layers=4, block=64, mode=LayoutMode.CROSS_LAYER)
    assert len(lay.buffers) == 2  # latent pages and indexer pages
    strides = sorted({pl.block_stride for pl in lay.placements.values()})
    # Four model layers own eight caches: four latent slots and four indexer slots.
    assert strides == [4 * 64 * 132, 4 * 64 * 1152]


def test_heads_major_keeps_a_head_contiguous_across_layers() -> None:
    lay = _layout("llama-3.1-8b", layers=4, mode=LayoutMode.CROSS_LAYER, heads_major=True)
    k0, k1 = lay.views[0]["k"], lay.views[1]["k"]
    # Head 0 of layer 1 starts right after head 0 of layer 0 inside a block.
    assert k1[2, 0, 0].data_ptr() == k0[2, 0, 0].data_ptr() + 16 * 128 * 2
    with pytest.raises(ConfigError):
        _layout("llama-3.1-8b", heads_major=True)


def test_describe_round_trip_of_numbers() -> None:
    lay = _layout("kimi-linear-48b-a3b", layers=4, block=128)
    desc = describe(lay)
    assert desc.num_blocks == 8 and desc.null_block == 0
    assert [g.kind.value for g in desc.groups] == [g.kind.value for g in lay.config.groups]
    assert {r.kind.value for r in desc.regions} == {"STATE", "REPLICATE"}


def test_hnc_views_match_pieces_and_stacked_slots_follow_each_other() -> None:
    """vLLM 0.32's layout: per head and token one row of K then V; layers in one buffer."""
    model = load_preset("llama-3.1-8b", layers=2)
    cfg = build_cache_config(model, 2, 128, num_blocks=4, kernel_multiple_of=32)
    assert cfg.groups[0].kernel_block_size == 128  # a MultipleOf backend runs the whole block
    layout = allocate(cfg, 1, kv_layout=KVLayout.HNC, stacked=True)
    assert len(layout.buffers) == 1
    page = cfg.slots[0].page_bytes
    buf = layout.buffers[0]
    assert buf.numel() == 2 * 4 * page
    for layer, pl in layout.placements.items():
        assert pl.base - buf.data_ptr() == layer * 4 * page
        row = 2 * 128 * 2  # K|V channels of one token, bf16
        k = layout.views[layer]["k"].view(torch.int16)
        v = layout.views[layer]["v"].view(torch.int16)
        # block 2, token 5, local head 3, channel 7 of K and of V
        k[2, 0, 5, 3, 7], v[2, 0, 5, 3, 7] = 11 + layer, 22 + layer
        head = pl.pieces[0].unit_stride
        at = pl.base - buf.data_ptr() + 2 * pl.block_stride + 3 * head + 5 * row + 7 * 2
        assert int(buf[at : at + 2].view(torch.int16)) == 11 + layer
        at += pl.pieces[1].offset
        assert int(buf[at : at + 2].view(torch.int16)) == 22 + layer
        held = [(p.unit_first, p.unit_count, p.outer_stride) for p in pl.pieces]
        assert held == [(4, 4, row)] * 2


def test_stacked_needs_per_layer_mode() -> None:
    cfg = build_cache_config(load_preset("llama-3.1-8b", layers=2), 1, 16, num_blocks=4)
    with pytest.raises(ConfigError, match="stacked"):
        allocate(cfg, 0, mode=LayoutMode.CROSS_LAYER, stacked=True)
