"""Property tests: plan, copy and verify byte-exact over presets x TP pairs x layouts.

Every preset (scaled down) runs on every listed TP pair and both allocation layouts; hypothesis
picks prompt lengths, chunk splits, the block layout and the Mamba block rule.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from app.kvcache.layout import KVLayout, LayoutMode
from app.kvcache.presets import load_preset
from app.sim.reference import blocks_needed, build_instance, run_transfer
from app.transfer.planning.planner import MambaMode

PRESETS = {  # name: (layers, block size)
    "llama-3.1-8b": (3, 16),
    "gpt-oss-20b": (4, 16),
    "gemma-3-27b": (6, 16),
    "qwen3-next-80b-a3b": (4, 16),
    "deepseek-v3.2-exp": (2, 64),
    "kimi-linear-48b-a3b": (4, 128),
    "nemotron-nano-9b-v2": (4, 16),
}
PAIRS = [(1, 1), (1, 2), (2, 1), (2, 4), (4, 2), (4, 1), (1, 4), (8, 2)]


@pytest.mark.parametrize("mode", list(LayoutMode))
@pytest.mark.parametrize(("p_tp", "d_tp"), PAIRS)
@pytest.mark.parametrize("model", sorted(PRESETS))
@settings(max_examples=4)
@given(
    lens=st.lists(st.integers(2, 700), min_size=1, max_size=3),
    chunk=st.sampled_from([None, 64, 100, 256]),
    kv=st.sampled_from(list(KVLayout)),
    heads_major=st.booleans(),
    mamba=st.sampled_from(list(MambaMode)),
    num_spec=st.integers(0, 1),
)
def test_transfer_is_byte_exact(
    model: str,
    p_tp: int,
    d_tp: int,
    mode: LayoutMode,
    lens: list[int],
    chunk: int | None,
    kv: KVLayout,
    heads_major: bool,
    mamba: MambaMode,
    num_spec: int,
) -> None:
    layers, bs = PRESETS[model]
    spec = load_preset(model, layers=layers)
    heads_major = heads_major and mode is LayoutMode.CROSS_LAYER and kv is KVLayout.HND
    spec_n = num_spec if mamba is MambaMode.ALIGN else 0
    p = build_instance(
        spec,
        p_tp,
        bs,
        blocks_needed(spec, p_tp, bs, lens, spec_n),
        mode=mode,
        kv_layout=kv,
        heads_major=heads_major,
    )
    d = build_instance(
        spec,
        d_tp,
        bs,
        blocks_needed(spec, d_tp, bs, lens, spec_n),
        mode=mode,
        kv_layout=kv,
        heads_major=heads_major,
        seed=7,
    )
    res = run_transfer(p, d, lens, chunk=chunk, mamba_mode=mamba, num_spec=spec_n)
    assert res.failed == {}
    assert res.problems == []
    assert res.bytes > 0
