"""Model presets: public config.json facts (shared/models) turned into per-layer cache specs.

The JSON files next to this module record the vLLM version whose formulas they follow
(``vllm_version``). A preset rank's identity is the compat hash of its registration
(``preset_registration``), the same hash a vLLM rank's gets.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

from app.errors import ConfigError
from app.kvcache.specs import (
    AttentionSpec,
    LayerSpec,
    MambaSpec,
    MLASpec,
    SpecKind,
    StatePart,
    StateTensor,
)

# Minimum kernel block sizes of the attention backends the presets assume.
KERNEL_BLOCK = {"attention": 16, "mla": 64}


@dataclass(frozen=True)
class CacheLayer:
    """One cache owner; a DeepSeek-V3.2 model layer owns two (MLA latent and indexer)."""

    index: int
    name: str
    spec: LayerSpec


@dataclass(frozen=True)
class ModelSpec:
    name: str
    hf_id: str
    vllm_version: str
    dtype: str
    layers: tuple[CacheLayer, ...]
    num_model_layers: int

    def kernel_block_size(self, spec: LayerSpec) -> int | None:
        """The attention kernel's block size for a spec; None for state (no tokens)."""
        if isinstance(spec, MambaSpec):
            return None
        return KERNEL_BLOCK["mla" if isinstance(spec, MLASpec) else "attention"]

    def default_block_size(self) -> int:
        """The smallest block size every attention kernel accepts (the largest kernel block)."""
        return max(k for c in self.layers if (k := self.kernel_block_size(c.spec)) is not None)


def _dt(d: dict[str, Any], key: str, default: str) -> str:
    return str(d.get(key, default))


def _build_spec(
    d: dict[str, Any], dtype: str, cache_dtype: str, conv_layout: str, ssm_dtype: str | None
) -> LayerSpec:
    kind = d["type"]
    if ssm_dtype is not None:
        d = {**d, "ssm_dtype": ssm_dtype}
    if kind == "attention":
        return AttentionSpec(
            kind=SpecKind(d["kind"]),
            num_kv_heads=d["num_kv_heads"],
            head_size=d["head_size"],
            head_size_v=d.get("head_size_v", d["head_size"]),
            dtype=dtype,
            sliding_window=d.get("sliding_window"),
        )
    if kind == "mla":
        return MLASpec(head_size=d["head_size"], dtype=dtype, cache_dtype=cache_dtype)
    if kind == "indexer":
        # 128 fp8 values + one fp32 scale per token, stored as uint8 rows.
        return MLASpec(head_size=d["head_size"], dtype="uint8", indexer=True)
    k = d["conv_kernel"] - 1
    if kind == "mamba2":
        h, p, g, n = d["num_heads"], d["head_dim"], d["n_groups"], d["state_size"]
        parts = (StatePart("x", h, p), StatePart("B", g, n), StatePart("C", g, n))
        ssm = StateTensor(
            "ssm", _dt(d, "ssm_dtype", dtype), (StatePart("h", h, p * n),), 1, False, (p, n)
        )
        return MambaSpec("mamba2", (StateTensor("conv", dtype, parts, k, True), ssm), conv_layout)
    if kind == "mamba1":
        c, n = d["intermediate_size"], d["state_size"]
        conv = StateTensor("conv", dtype, (StatePart("x", c, 1),), k, True)
        ssm = StateTensor(
            "ssm", _dt(d, "ssm_dtype", dtype), (StatePart("x", c, n),), 1, False, (n,)
        )
        return MambaSpec("mamba1", (conv, ssm), conv_layout)
    if kind == "gdn":
        hk, hv, dk, dv = d["num_k_heads"], d["num_v_heads"], d["head_k_dim"], d["head_v_dim"]
        parts = (StatePart("q", hk, dk), StatePart("k", hk, dk), StatePart("v", hv, dv))
        # vLLM >= 0.20 (PR #33291) orders the ssm state (Hv, Dv, Dk).
        ssm = StateTensor(
            "ssm", _dt(d, "ssm_dtype", dtype), (StatePart("h", hv, dv * dk),), 1, False, (dv, dk)
        )
        return MambaSpec("gdn", (StateTensor("conv", dtype, parts, k, True), ssm), conv_layout)
    if kind == "kda":
        h, hd = d["num_heads"], d["head_dim"]
        parts = (StatePart("q", h, hd), StatePart("k", h, hd), StatePart("v", h, hd))
        rec = StateTensor(
            "recurrent",
            _dt(d, "recurrent_dtype", "float32"),
            (StatePart("h", h, hd * hd),),
            1,
            False,
            (hd, hd),
        )
        return MambaSpec("kda", (StateTensor("conv", dtype, parts, k, True), rec), conv_layout)
    raise ConfigError(f"unknown layer type {kind!r} in a preset")


@cache
def _raw_presets() -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for f in resources.files("app.kvcache").joinpath("presets").iterdir():
        if f.name.endswith(".json"):
            data = json.loads(f.read_text())
            out[data["name"]] = data
    return out


def preset_names() -> list[str]:
    return sorted(_raw_presets())


def _scaled_pattern(pattern: str, cached: set[str], layers: int) -> str:
    """Keep ``layers`` cache-carrying layers with the model's pattern.

    A periodic pattern keeps its period (the first ``layers`` layers); an irregular one is sampled
    evenly, and every kind the full model has is kept at least once.
    """
    seq = [c for c in pattern if c in cached]
    if layers >= len(seq):
        return "".join(seq)
    for period in range(1, len(seq) // 2 + 1):
        if all(seq[i] == seq[i % period] for i in range(len(seq))):
            return "".join(seq[i % period] for i in range(layers))
    picks = [round(i * (len(seq) - 1) / max(1, layers - 1)) for i in range(layers)]
    out = [seq[i] for i in picks]
    for kind in dict.fromkeys(seq):
        if kind not in out:
            # Replace the most common kind's last pick so the missing kind appears once.
            common = max(set(out), key=out.count)
            out[len(out) - 1 - out[::-1].index(common)] = kind
    return "".join(out)


def load_preset(
    name: str,
    *,
    layers: int | None = None,
    dtype: str | None = None,
    cache_dtype: str = "auto",
    conv_layout: str = "SD",
    ssm_dtype: str | None = None,
) -> ModelSpec:
    """A preset by name, optionally scaled down to ``layers`` cache-carrying layers.

    ``ssm_dtype`` replaces the preset's Mamba/GDN ssm state dtype: the engine may choose
    another at run time (vLLM's CPU platform keeps GDN state in float32 on CPUs with AVX-512
    BF16 unless ``--mamba-ssm-cache-dtype`` says otherwise), and the engine's choice wins.
    """
    raw = _raw_presets().get(name)
    if raw is None:
        raise ConfigError(f"unknown model {name!r}; choose one of: {', '.join(preset_names())}")
    if conv_layout not in ("SD", "DS"):
        raise ConfigError(f"conv layout must be SD or DS, not {conv_layout!r}")
    model_dtype = dtype or raw["dtype"]
    specs = {
        key: [_build_spec(d, model_dtype, cache_dtype, conv_layout, ssm_dtype) for d in entries]
        for key, entries in raw["specs"].items()
    }
    pattern: str = raw["layers"]
    cached = {k for k, v in specs.items() if v}
    if layers is not None:
        if layers < 1:
            raise ConfigError(f"--layers must be at least 1, not {layers}")
        pattern = _scaled_pattern(pattern, cached, layers)
    out: list[CacheLayer] = []
    model_layer = 0
    for ch in pattern:
        for spec in specs[ch]:
            suffix = ".indexer" if isinstance(spec, MLASpec) and spec.indexer else ""
            out.append(CacheLayer(len(out), f"layers.{model_layer}{suffix}", spec))
        model_layer += 1
    return ModelSpec(
        name=name,
        hf_id=raw["hf_id"],
        vllm_version=raw["vllm_version"],
        dtype=model_dtype,
        layers=tuple(out),
        num_model_layers=model_layer,
    )
