"""Page sizes and state shapes against the numbers in shared/models/STATE_SHAPES.md."""

from __future__ import annotations

import pytest

from app.errors import ConfigError
from app.kvcache.groups import build_cache_config, hybrid_block_size
from app.kvcache.presets import load_preset
from app.kvcache.specs import AttentionSpec, MambaSpec, MLASpec


def _first(name: str, cls: type) -> object:
    return next(c.spec for c in load_preset(name).layers if isinstance(c.spec, cls))


@pytest.mark.parametrize(
    ("model", "per_token"),
    [
        ("llama-3.1-8b", 4096),
        ("gpt-oss-20b", 2048),
        ("gemma-3-27b", 8192),
        ("qwen3-next-80b-a3b", 2048),
        ("nemotron-nano-9b-v2", 4096),
    ],
)
def test_attention_bytes_per_token(model: str, per_token: int) -> None:
    spec = _first(model, AttentionSpec)
    assert isinstance(spec, AttentionSpec)
    assert spec.bytes_per_token(1) == per_token


def test_qwen3_next_kv_heads_replicate_past_tp2() -> None:
    spec = _first("qwen3-next-80b-a3b", AttentionSpec)
    assert isinstance(spec, AttentionSpec)
    assert [spec.heads_per_rank(tp) for tp in (1, 2, 4, 8)] == [2, 1, 1, 1]


@pytest.mark.parametrize(
    ("model", "tp", "nbytes"),
    [
        ("qwen3-next-80b-a3b", 1, 1_097_728),
        ("qwen3-next-80b-a3b", 2, 548_864),
        ("qwen3-next-80b-a3b", 4, 274_432),
        ("kimi-linear-48b-a3b", 1, 2_170_880),
        ("nemotron-nano-9b-v2", 1, 5_316_608),
        ("nemotron-nano-9b-v2", 8, 664_576),
    ],
)
def test_state_bytes(model: str, tp: int, nbytes: int) -> None:
    spec = _first(model, MambaSpec)
    assert isinstance(spec, MambaSpec)
    assert spec.state_bytes(tp) == nbytes


def test_state_shapes_follow_vllm_033() -> None:
    gdn = _first("qwen3-next-80b-a3b", MambaSpec)
    assert isinstance(gdn, MambaSpec)
    assert [s.shape(1, "SD") for s in gdn.states] == [(3, 8192), (32, 128, 128)]
    assert gdn.states[0].shape(2, "DS") == (4096, 3)
    kda = _first("kimi-linear-48b-a3b", MambaSpec)
    assert isinstance(kda, MambaSpec)
    assert [(s.shape(1, "SD"), s.dtype) for s in kda.states] == [
        ((3, 12288), "bfloat16"),
        ((32, 128, 128), "float32"),
    ]
    m2 = _first("nemotron-nano-9b-v2", MambaSpec)
    assert isinstance(m2, MambaSpec)
    assert [s.shape(1, "SD") for s in m2.states] == [(3, 12288), (128, 80, 128)]


def test_mla_and_indexer_rows() -> None:
    m = load_preset("deepseek-v3.2-exp")
    latent, indexer = m.layers[0].spec, m.layers[1].spec
    assert isinstance(latent, MLASpec) and isinstance(indexer, MLASpec)
    assert (latent.bytes_per_token(4), indexer.bytes_per_token(4)) == (1152, 132)
    packed = load_preset("deepseek-v3.2-exp", cache_dtype="fp8_ds_mla").layers[0].spec
    assert isinstance(packed, MLASpec)
    assert packed.bytes_per_token(1) == 656
    assert len(m.layers) == 122 and m.num_model_layers == 61


@pytest.mark.parametrize(
    ("model", "tp", "block"),
    [
        ("qwen3-next-80b-a3b", 1, 544),
        ("qwen3-next-80b-a3b", 2, 544),
        ("qwen3-next-80b-a3b", 4, 272),
        ("nemotron-nano-9b-v2", 1, 1312),
        ("kimi-linear-48b-a3b", 1, 1920),
        ("llama-3.1-8b", 1, 16),
    ],
)
def test_hybrid_block_size(model: str, tp: int, block: int) -> None:
    m = load_preset(model)
    start = 64 if model.startswith("kimi") else 16
    assert hybrid_block_size(m, tp, start) == block


def test_state_page_padded_to_attention_page() -> None:
    cfg = build_cache_config(load_preset("qwen3-next-80b-a3b"), 1, 16, num_blocks=4)
    assert {s.page_bytes for s in cfg.slots} == {544 * 2048}


def test_groups_follow_vllm_bucketing() -> None:
    gemma = build_cache_config(load_preset("gemma-3-27b"), 1, 16, num_blocks=4)
    # 52 sliding + 10 full: groups of 10, so the sliding bucket becomes cdiv(52, 10) = 6 groups
    # cut by stride (layers[i::6]: 9, 9, 9, 9, 8, 8 layers), not contiguous 10s and a 2.
    assert [len(g.layers) for g in gemma.groups] == [9, 9, 9, 9, 8, 8, 10]
    assert [c.index for c in gemma.groups[0].layers] == [0, 7, 14, 21, 28, 36, 43, 50, 57]
    assert [c.index for c in gemma.groups[6].layers] == list(range(5, 62, 6))
    assert len(gemma.slots) == 10
    # Layer i of every group shares slot i; only the full group has a tenth layer.
    assert gemma.slots[1].members[0] == (0, gemma.groups[0].layers[1].index)
    assert gemma.slots[9].members == ((6, 59),)
    gpt = build_cache_config(load_preset("gpt-oss-20b"), 2, 16, num_blocks=4)
    assert [(g.kind.value, len(g.layers)) for g in gpt.groups] == [
        ("sliding_window", 12),
        ("full_attention", 12),
    ]
    ds = build_cache_config(load_preset("deepseek-v3.2-exp"), 1, 64, num_blocks=4)
    assert len(ds.groups) == 1 and len(ds.slots) == 122
    assert {s.page_bytes for s in ds.slots} == {64 * 1152, 64 * 132}


def test_num_blocks_from_budget() -> None:
    m = load_preset("llama-3.1-8b")
    cfg = build_cache_config(m, 2, 16, memory_bytes=1 << 30)
    per_block = 32 * 16 * 2048
    assert cfg.bytes_per_block == per_block
    assert cfg.num_blocks == (1 << 30) // per_block


@pytest.mark.parametrize(
    ("model", "tp", "block", "words"),
    [
        ("llama-3.1-8b", 3, 16, "TP size that divides 8"),
        ("deepseek-v3.2-exp", 1, 16, "multiple of 64"),
        ("llama-3.1-8b", 1, 24, "multiple of 16"),
        ("nemotron-nano-9b-v2", 16, 16, "at most 8"),
    ],
)
def test_bad_configs_say_what_to_change(model: str, tp: int, block: int, words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        build_cache_config(load_preset(model), tp, block, num_blocks=4)


def test_budget_too_small() -> None:
    with pytest.raises(ConfigError, match="null block"):
        build_cache_config(load_preset("llama-3.1-8b"), 1, 16, memory_bytes=1000)
