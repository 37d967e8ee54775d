"""Presets: layer patterns of the real models, scaling down, compat hashes."""

from __future__ import annotations

from collections import Counter

import pytest

from app.errors import ConfigError
from app.kvcache.presets import load_preset, preset_names
from app.kvcache.specs import SpecKind

REQUIRED = {
    "llama-3.1-8b",
    "gpt-oss-20b",
    "gemma-3-27b",
    "qwen3-next-80b-a3b",
    "deepseek-v3.2-exp",
    "kimi-linear-48b-a3b",
    "nemotron-nano-9b-v2",
}


def _kinds(name: str, layers: int | None = None) -> Counter[str]:
    return Counter(c.spec.kind.value for c in load_preset(name, layers=layers).layers)


def test_required_presets_exist() -> None:
    assert set(preset_names()) >= REQUIRED


@pytest.mark.parametrize(
    ("name", "counts"),
    [
        ("qwen3-next-80b-a3b", {"mamba": 36, "full_attention": 12}),
        ("kimi-linear-48b-a3b", {"mamba": 20, "mla": 7}),
        ("nemotron-nano-9b-v2", {"mamba": 27, "full_attention": 4}),
        ("gemma-3-27b", {"sliding_window": 52, "full_attention": 10}),
        ("gpt-oss-20b", {"sliding_window": 12, "full_attention": 12}),
        ("deepseek-v3.2-exp", {"mla": 122}),
    ],
)
def test_full_layer_patterns(name: str, counts: dict[str, int]) -> None:
    assert _kinds(name) == counts


def test_kimi_mla_layers_are_one_based_in_config() -> None:
    m = load_preset("kimi-linear-48b-a3b")
    mla = [int(c.name.split(".")[1]) for c in m.layers if c.spec.kind is SpecKind.MLA]
    assert mla == [3, 7, 11, 15, 19, 23, 26]


@pytest.mark.parametrize("name", sorted(REQUIRED))
def test_scaling_keeps_every_kind(name: str) -> None:
    full = set(_kinds(name))
    small = load_preset(name, layers=6)
    assert {c.spec.kind.value for c in small.layers} == full
    assert [c.index for c in small.layers] == list(range(len(small.layers)))


def test_scaling_keeps_a_periodic_pattern() -> None:
    m = load_preset("qwen3-next-80b-a3b", layers=8)
    assert [c.spec.kind.value[0] for c in m.layers] == list("mmmfmmmf")


def test_unknown_model_lists_the_choices() -> None:
    with pytest.raises(ConfigError, match="qwen3-next-80b-a3b"):
        load_preset("qwen4")
