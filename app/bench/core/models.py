"""The random-weight model the real-engine benches start their engines on (``write_tiny_model``
overrides): ``bench pd``, ``bench load``, ``bench soak``, ``bench faults`` and ``bench turns``."""

from __future__ import annotations

from app.harness.tiny_models import LONG_POSITIONS

FULL_MODEL = {  # random-weight Llama: hidden 1024, 16 layers, 4 KV heads of 128, bf16
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "num_hidden_layers": 16,
    "max_position_embeddings": LONG_POSITIONS,  # 32k and 64k prompts (tiny_models: plain RoPE)
}  # LocalPD's initializer range (0.5): with 0.1, near-tied logits flipped greedy tokens


QUICK_MODEL = {  # --quick: the same shape, smaller (4 layers, hidden 512)
    "hidden_size": 512,
    "intermediate_size": 1024,
    "head_dim": 64,
    "num_hidden_layers": 4,
    "max_position_embeddings": 4096,
}
