"""A preset rank's registration, read by the sidecar's engine builder, is the preset layout.

Two independent builders: ``allocate`` computes placements and regions from the specs, and
``describe_engine`` computes them from the axes and strides that ``preset_registration`` reads
off the rank's tensor views. They must agree for every preset, TP size and layout; otherwise the
planner (``describe``) and the sidecar (``describe_engine``) would move different bytes.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from app.errors import ConfigError
from app.kvcache.engine_layout import describe_engine, engine_compat_hash
from app.kvcache.groups import build_cache_config
from app.kvcache.layout import KVLayout, LayoutMode, RankLayout, allocate
from app.kvcache.preset_registration import describe, preset_registration
from app.kvcache.presets import load_preset, preset_names
from app.kvcache.specs import AttentionSpec

# (mode, kv layout, heads major, stacked): vLLM's own is per-layer HNC stacked; the others are
# the simulated engine's, which need the ``kernel`` axis where a block is not adjacent kernel
# blocks (cross-layer pages of hybrids, heads-major).
LAYOUTS = [
    (LayoutMode.PER_LAYER, KVLayout.HND, False, False),
    (LayoutMode.PER_LAYER, KVLayout.NHD, False, False),
    (LayoutMode.PER_LAYER, KVLayout.HNC, False, True),
    (LayoutMode.CROSS_LAYER, KVLayout.HND, False, False),
    (LayoutMode.CROSS_LAYER, KVLayout.NHD, False, False),
    (LayoutMode.CROSS_LAYER, KVLayout.HND, True, False),
]


def _empty(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8)


def _layout(
    name: str, tp: int, rank: int, layout: tuple[LayoutMode, KVLayout, bool, bool], **kw: object
) -> RankLayout:
    mode, kv, heads_major, stacked = layout
    model = load_preset(name, **kw)  # type: ignore[arg-type]
    cfg = build_cache_config(model, tp, model.default_block_size(), num_blocks=3)
    if heads_major and any(
        isinstance(c.spec, AttentionSpec) and c.spec.head_size != c.spec.head_size_v
        for c in model.layers
    ):
        pytest.skip("heads-major needs equal K and V head sizes")
    return allocate(
        cfg,
        rank,
        mode=mode,
        kv_layout=kv,
        heads_major=heads_major,
        stacked=stacked,
        allocator=_empty,
    )


def _check(layout: RankLayout) -> None:
    want = describe(layout)
    reg = preset_registration(layout)
    got = describe_engine(reg, [b.data_ptr() for b in layout.buffers])
    assert got.groups == want.groups
    assert got.placements == want.placements
    assert got.regions == want.regions
    assert (got.tp, got.rank, got.num_blocks, got.null_block) == (
        want.tp,
        want.rank,
        want.num_blocks,
        want.null_block,
    )
    assert got.compat_hash == want.compat_hash == engine_compat_hash(reg)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: "-".join(map(str, x)))
@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("name", preset_names())
def test_engine_builder_reproduces_the_preset_layout(
    name: str, tp: int, layout: tuple[LayoutMode, KVLayout, bool, bool]
) -> None:
    for rank in sorted({0, tp - 1}):
        try:
            lay = _layout(name, tp, rank, layout, layers=6)
        except ConfigError as e:  # a TP size the model cannot shard
            pytest.skip(str(e))
        _check(lay)


@pytest.mark.parametrize("name", preset_names())
def test_full_size_presets(name: str) -> None:
    _check(_layout(name, 1, 0, LAYOUTS[0]))


@pytest.mark.parametrize(
    ("conv_layout", "ssm_dtype", "cache_dtype"),
    [("DS", None, "auto"), ("SD", "float32", "auto"), ("SD", None, "fp8_ds_mla")],
)
def test_state_and_latent_variants(
    conv_layout: str, ssm_dtype: str | None, cache_dtype: str
) -> None:
    kw = {"layers": 4, "conv_layout": conv_layout, "ssm_dtype": ssm_dtype}
    for name, layout, tp in itertools.product(preset_names(), LAYOUTS[:4], (1, 2)):
        try:
            lay = _layout(name, tp, tp - 1, layout, cache_dtype=cache_dtype, **kw)
        except ConfigError:
            continue  # a TP size the model cannot shard
        _check(lay)


def test_the_hash_ignores_layout_and_tp_but_not_the_model() -> None:
    a = describe(_layout("llama-3.1-8b", 1, 0, LAYOUTS[0], layers=2)).compat_hash
    assert a == describe(_layout("llama-3.1-8b", 2, 1, LAYOUTS[3], layers=2)).compat_hash
    assert a != describe(_layout("llama-3.1-8b", 1, 0, LAYOUTS[0], layers=3)).compat_hash
    assert a != describe(_layout("gpt-oss-20b", 1, 0, LAYOUTS[0], layers=2)).compat_hash
    assert (
        a
        != describe(
            _layout("llama-3.1-8b", 1, 0, LAYOUTS[0], layers=2, dtype="float16")
        ).compat_hash
    )
