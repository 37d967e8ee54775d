"""Tiny models with random weights for local engines: written once with a fixed seed, so every
engine that loads one loads the same bytes, and greedy outputs are distinct per prompt."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from app.errors import ConfigError

_COMMON = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "vocab_size": 1024,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "torch_dtype": "bfloat16",
    "initializer_range": 0.5,  # large enough for distinct greedy tokens
}
# Long-context benches and tests (128k prompts). Plain RoPE: its angles depend on the position
# and rope_theta alone, so raising the limit changes no output at shorter lengths. No rope
# scaling: on random weights it would only exercise a code path, not make long prompts "work".
LONG_POSITIONS = 131072
TINY_MODELS: dict[str, dict[str, Any]] = {
    "llama": {  # GQA: 4 query heads over 2 KV heads
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "num_key_value_heads": 2,
        "head_dim": 64,
        "num_hidden_layers": 2,
        "tie_word_embeddings": False,
    },
    "llama-long": {  # llama with 128k positions (engines still need a --max-model-len as long)
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "num_key_value_heads": 2,
        "head_dim": 64,
        "num_hidden_layers": 2,
        "tie_word_embeddings": False,
        "max_position_embeddings": LONG_POSITIONS,
    },
    "gemma3": {  # sliding window (64 tokens) + full attention, vLLM splits them by stride
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "num_key_value_heads": 2,
        "head_dim": 64,
        "num_hidden_layers": 4,
        "sliding_window": 64,
        "layer_types": [
            "sliding_attention",
            "full_attention",
            "sliding_attention",
            "full_attention",
        ],
        "query_pre_attn_scalar": 64,
        "tie_word_embeddings": False,
        "initializer_range": 0.1,  # 0.5 saturates Gemma's soft-capping: one token forever
    },
    "qwen3next": {  # Gated DeltaNet (3 layers) + full attention (1), MoE
        "architectures": ["Qwen3NextForCausalLM"],
        "model_type": "qwen3_next",
        "num_key_value_heads": 2,
        "head_dim": 64,
        "num_hidden_layers": 4,
        "tie_word_embeddings": False,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 128,  # vLLM's CPU GDN kernels take 128
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "full_attention_interval": 4,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 128,
        "shared_expert_intermediate_size": 128,
        "decoder_sparse_step": 1,
        "partial_rotary_factor": 0.25,
        "rope_theta": 10000.0,
        "initializer_range": 1.5,  # with 0.5 greedy outputs of this tiny model barely differ
    },
    "deepseek": {  # MLA, latent 512 + rope 64 (what vLLM's CPU MLA backend takes)
        "architectures": ["DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v2",
        "num_key_value_heads": 4,
        "num_hidden_layers": 2,
        "kv_lora_rank": 512,
        "q_lora_rank": None,
        "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 128,
        "v_head_dim": 128,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 128,
        "first_k_dense_replace": 2,
        "moe_layer_freq": 1,
        "n_shared_experts": 1,
        "tie_word_embeddings": False,
    },
}


def write_tiny_model(
    path: Path, kind: str, seed: int = 0, overrides: Mapping[str, Any] | None = None
) -> Path:
    """``config.json`` plus one safetensors file of random weights (idempotent).

    ``overrides`` replace keys of the tiny config (e.g. a preset's KV geometry at a few layers).
    """
    if kind not in TINY_MODELS:
        raise ConfigError(f"unknown tiny model {kind!r}; expected one of {sorted(TINY_MODELS)}")
    if (path / "model.safetensors").exists():
        return path
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(
        json.dumps({**_COMMON, **TINY_MODELS[kind], **(overrides or {})})
    )
    config = AutoConfig.from_pretrained(str(path))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    weights = {
        k: v.clone().contiguous()
        for k, v in model.state_dict().items()
        if not (tied and k == "lm_head.weight")
    }
    save_file(weights, str(path / "model.safetensors.tmp"))
    os.replace(path / "model.safetensors.tmp", path / "model.safetensors")
    return path


def write_tiny_eagle(
    path: Path, target: Path, seed: int = 0, overrides: Mapping[str, Any] | None = None
) -> Path:
    """A random one-layer EAGLE head for the tiny model at ``target`` (idempotent).

    vLLM's ``EagleLlamaForCausalLM`` reads ``fc`` (the input embedding and the target's hidden
    state, concatenated, down to the hidden size) and one decoder layer; it shares the
    target's embeddings and ``lm_head`` when the head has none, and layer 0's input norm is
    an identity there. ``overrides`` change the head's config (e.g. its own KV heads).
    """
    if (path / "model.safetensors").exists():
        return path
    import torch
    from safetensors.torch import save_file

    base = json.loads((target / "config.json").read_text())
    config = {
        **base,
        "architectures": ["LlamaForCausalLM"],
        "num_hidden_layers": 1,
        "tie_word_embeddings": False,
        **(overrides or {}),
    }
    hidden, inner = int(config["hidden_size"]), int(config["intermediate_size"])
    if hidden != int(base["hidden_size"]):
        raise ConfigError(
            f"an EAGLE head reads the target's hidden state: hidden_size {hidden} must be the "
            f"target's {base['hidden_size']}"
        )
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads", heads))
    head_dim = int(config.get("head_dim") or hidden // heads)
    torch.manual_seed(seed)

    def weight(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape) * 0.02).to(torch.bfloat16)

    layer = "layers.0."
    weights = {
        "fc.weight": weight(hidden, 2 * hidden),
        f"{layer}self_attn.q_proj.weight": weight(heads * head_dim, hidden),
        f"{layer}self_attn.k_proj.weight": weight(kv_heads * head_dim, hidden),
        f"{layer}self_attn.v_proj.weight": weight(kv_heads * head_dim, hidden),
        f"{layer}self_attn.o_proj.weight": weight(hidden, heads * head_dim),
        f"{layer}mlp.gate_proj.weight": weight(inner, hidden),
        f"{layer}mlp.up_proj.weight": weight(inner, hidden),
        f"{layer}mlp.down_proj.weight": weight(hidden, inner),
        f"{layer}post_attention_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
    }
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file(weights, str(path / "model.safetensors.tmp"), metadata={"format": "pt"})
    os.replace(path / "model.safetensors.tmp", path / "model.safetensors")
    return path


def write_tiny_lora(
    path: Path,
    base: Path,
    seed: int = 0,
    rank: int = 8,
    targets: tuple[str, ...] = ("q_proj", "v_proj"),
) -> Path:
    """A random LoRA adapter, in peft's layout, for the tiny model at ``base`` (idempotent).

    Both A and B are random (peft starts B at zero, which would leave the model unchanged):
    the adapter must change the attention's K and V, so that its KV differs from the base
    model's and from another adapter's.
    """
    if (path / "adapter_model.safetensors").exists():
        return path
    import torch
    from safetensors.torch import save_file

    config = json.loads((base / "config.json").read_text())
    hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or hidden // heads)
    kv_heads = int(config.get("num_key_value_heads", heads))
    out = {
        "q_proj": heads * head_dim,
        "k_proj": kv_heads * head_dim,
        "v_proj": kv_heads * head_dim,
        "o_proj": hidden,
    }
    unknown = sorted(set(targets) - set(out))
    if unknown:
        raise ConfigError(f"LoRA targets {unknown}: expected some of {sorted(out)}")
    torch.manual_seed(seed)
    weights: dict[str, torch.Tensor] = {}
    for layer in range(int(config["num_hidden_layers"])):
        for t in targets:
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{t}"
            in_features = heads * head_dim if t == "o_proj" else hidden
            weights[f"{prefix}.lora_A.weight"] = torch.randn(rank, in_features) * 0.2
            weights[f"{prefix}.lora_B.weight"] = torch.randn(out[t], rank) * 0.2
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text(
        json.dumps(
            {
                "peft_type": "LORA",
                "task_type": "CAUSAL_LM",
                "r": rank,
                "lora_alpha": 2 * rank,
                "lora_dropout": 0.0,
                "bias": "none",
                "target_modules": list(targets),
                "base_model_name_or_path": str(base),
            }
        )
    )
    save_file(weights, str(path / "adapter_model.safetensors.tmp"), metadata={"format": "pt"})
    os.replace(path / "adapter_model.safetensors.tmp", path / "adapter_model.safetensors")
    return path
