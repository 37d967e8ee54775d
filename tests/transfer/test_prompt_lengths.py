"""Every prompt length transfers: lengths around every block boundary, for every preset.

Decode allocates blocks for the ``prompt_len - 1`` tokens it loads (vLLM does), so a planner
that plans the whole prompt needs one block more than decode has at ``k·B + 1`` tokens and
fails the request (129 / 257 / 385 tokens at block size 128 did, on real engines). Chunked
prefill splits the prompt right at the boundary too.
"""

from __future__ import annotations

import pytest

from app.kvcache.groups import build_cache_config
from app.kvcache.layout import KVLayout, LayoutMode
from app.kvcache.presets import load_preset, preset_names
from app.sim.reference import blocks_needed, build_instance, run_transfer


def boundary_lengths(model: str, tp: int, block_size: int) -> list[int]:
    """``k·B - 1 .. k·B + 2`` for every manager and kernel block size of every group."""
    config = build_cache_config(load_preset(model, layers=4), tp, block_size, num_blocks=2)
    sizes = {g.block_size for g in config.groups} | {g.kernel_block_size for g in config.groups}
    return sorted({k * b + d for b in sizes for k in (1, 2) for d in (-1, 0, 1, 2) if k * b > 2})


@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 1), (2, 1), (1, 2)])
@pytest.mark.parametrize("model", preset_names())
def test_lengths_around_block_boundaries(model: str, p_tp: int, d_tp: int) -> None:
    spec = load_preset(model, layers=4)
    bs = spec.default_block_size()
    lens = boundary_lengths(model, max(p_tp, d_tp), bs)
    p = build_instance(spec, p_tp, bs, blocks_needed(spec, p_tp, bs, lens),
                       mode=LayoutMode.PER_LAYER, kv_layout=KVLayout.HND)  # fmt: skip
    d = build_instance(spec, d_tp, bs, blocks_needed(spec, d_tp, bs, lens),
                       mode=LayoutMode.PER_LAYER, kv_layout=KVLayout.HND, seed=7)  # fmt: skip
    chunk = min(lens) - 1  # a chunk boundary lands one token before a block boundary
    res = run_transfer(p, d, lens, chunk=chunk)
    assert res.failed == {}, f"lengths {lens}"
    assert res.problems == [], res.problems[:5]
    assert res.bytes > 0
