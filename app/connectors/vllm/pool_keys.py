"""What names a request's KV in the pool besides its tokens: vLLM's own per-block extra keys.

vLLM's prefix cache keys each block on more than its tokens (``kv_cache_utils.
generate_block_hash_extra_keys``): the LoRA adapter (name and path), the multimodal inputs that
overlap the block with their offsets in it, the cache salt (first block), prompt embeddings. The
pool names a block by its tokens and exactly these keys, computed here with vLLM's own function
and handed to the sidecar as runs (``app.store.hashing.expand_key_runs``), so two requests share
a pool object exactly when vLLM's block hashes would be equal.

A request whose KV the pool cannot name goes without the pool, never under a guessed name:
prompt embeddings (the connector moves no KV for them, and decode computes them), and any key
that has no canonical encoding (a future vLLM key type).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import reduce
from typing import Any

from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys

from app.store.hashing import KeyRun, expand_key_runs

# Why a request goes without the pool (the counter's label and the log's words).
SKIP_EMBEDS = "prompt_embeds"
SKIP_UNKEYABLE = "unkeyable_extra_key"


def hash_block_size(kv_cache_config: Any) -> int:
    """The block size the pool hashes at: the gcd of the groups' block sizes, as the
    sidecar's coordinator computes it from the same engine's registration."""
    sizes = [int(g.kv_cache_spec.block_size) for g in kv_cache_config.kv_cache_groups]
    return reduce(math.gcd, sizes) if sizes else 1


def without_keys(request: Any) -> str | None:
    """Why ``request`` cannot be keyed at all (None: it can): checked before anything reads
    its token ids, which a prompt-embeds request may not have."""
    if getattr(request, "prompt_embeds", None) is not None:
        return SKIP_EMBEDS
    if getattr(request, "prompt_token_ids", None) is None:
        return SKIP_EMBEDS
    return None


def kv_inputs(request: Any) -> list[tuple[str | int, ...]]:
    """What decides a request's KV besides its token ids, whatever the block size: the LoRA
    adapter (name and path) and each multimodal input (its hash, offset and length). A P/D
    target binds these with the prompt (``target_auth.prompt_digest``)."""
    out: list[tuple[str | int, ...]] = []
    lora = request.lora_request
    if lora is not None:
        out.append(("lora", str(lora.lora_name), str(lora.lora_path)))
    for f in request.mm_features or ():
        out.append(("mm", str(f.identifier), int(f.mm_position.offset), int(f.mm_position.length)))
    return out


def key_runs(request: Any, num_tokens: int, block_size: int) -> list[KeyRun] | None:
    """vLLM's extra keys of every hash block of the request's first ``num_tokens`` tokens (a
    partial last block included: a tail is named with its block's keys), as runs; None when
    one of them has no canonical encoding."""
    blocks = -(-num_tokens // block_size)
    if blocks == 0:
        return []
    if request.mm_features:
        keys = _every_block(request, num_tokens, block_size, blocks)
    else:
        # Without multimodal inputs vLLM's keys do not depend on the block's tokens: the
        # first block (it carries the salt) and the second stand for every later one.
        keys = [_keys(request, b * block_size, (b + 1) * block_size, 0)[0] for b in range(2)]
    runs: list[KeyRun] = []
    for k in keys:
        if runs and runs[-1][1] == k:
            runs[-1] = (runs[-1][0] + 1, k)
        else:
            runs.append((1, k))
    if not request.mm_features:
        runs[-1] = (0, runs[-1][1])  # the last run stands for every later block
    try:
        expand_key_runs(runs, blocks)
    except Exception:  # a key type vLLM added that msgpack cannot encode canonically
        return None
    return runs


def _every_block(
    request: Any, num_tokens: int, block_size: int, blocks: int
) -> list[Sequence[Any]]:
    out: list[Sequence[Any]] = []
    mm_idx = 0
    for b in range(blocks):
        start = b * block_size
        keys, mm_idx = _keys(request, start, min(start + block_size, num_tokens), mm_idx)
        out.append(keys)
    return out


def _keys(request: Any, start: int, end: int, mm_idx: int) -> tuple[list[Any], int]:
    keys, mm_idx = generate_block_hash_extra_keys(request, start, end, mm_idx)
    return list(keys or ()), mm_idx
