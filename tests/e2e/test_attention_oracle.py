"""Attention bytes at decode, expected from the logical tensor alone.

The oracle knows nothing of the planner or of ``app.kvcache.layout``: it writes down once the
physical layout vLLM documents for a per-layer KV cache (FlashInfer's
``(num_blocks, 2, block_size, num_kv_heads, head_size)``, K before V, and its HND stride order
``(num_blocks, 2, num_kv_heads, block_size, head_size)``), one tensor per layer for a model with
one KV cache group, each TP rank holding ``num_kv_heads / tp`` consecutive heads. The value of
(request, layer, K or V, token, global head, channel) is the simulated engine's fill function.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from app.sim.cluster import Cluster
from app.sim.fill import mix, request_salt
from app.sim.rounds import summarize

# Llama 3.1 8B (shared/models): 8 KV heads of 128 channels, bf16; vLLM's default block of 16.
HEADS, HEAD_SIZE, BLOCK, LAYERS = 8, 128, 16, 2
LENS = [160, 96, 48]  # whole blocks: decode's blocks hold nothing but the prompt


def _segments(c: Cluster, rank: int) -> list[Path]:
    """Decode rank ``rank``'s KV tensors, in the order the engine allocated them."""
    prefix = f"{Path(c.tmp).name}-decode-r{rank}-"
    files = Path("/dev/shm").glob(f"{prefix}*")
    return sorted(files, key=lambda f: int(f.name.rsplit("-", 1)[1]))


def _physical(path: Path, heads: int, kv_layout: str) -> np.ndarray:
    """One layer's tensor as ``[block, K|V, token, head, channel]`` of bf16 bits."""
    raw = np.fromfile(path, dtype=np.int16)
    page = 2 * BLOCK * heads * HEAD_SIZE
    assert raw.size % page == 0, f"{path.name}: {raw.size} elements, not whole pages of {page}"
    if kv_layout == "NHD":
        return raw.reshape(-1, 2, BLOCK, heads, HEAD_SIZE)
    return raw.reshape(-1, 2, heads, BLOCK, HEAD_SIZE).transpose(0, 1, 3, 2, 4)


@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
@pytest.mark.parametrize(("p_tp", "d_tp"), [(2, 1), (1, 2), (4, 2)])
def test_decode_attention_bytes_equal_the_logical_tensor(
    make_cluster: Callable[..., Cluster], kv_layout: str, p_tp: int, d_tp: int
) -> None:
    c = make_cluster(
        model="llama-3.1-8b",
        layers=LAYERS,
        prefill_tp=p_tp,
        decode_tp=d_tp,
        kv_layout=kv_layout,
        block_size=BLOCK,
        max_requests=len(LENS),
        max_prompt=max(LENS),
    )
    pairs = c.make_requests(LENS)
    s = summarize(c.run(pairs, chunk=64), pairs)
    assert s["failures"] == {} and s["verified"] == len(LENS)
    heads = HEADS // d_tp
    for rank in range(d_tp):
        tensors = _segments(c, rank)
        assert len(tensors) == LAYERS, [t.name for t in tensors]
        first_head = rank * heads
        for layer, path in enumerate(tensors):
            kv = _physical(path, heads, kv_layout)
            for _, dr in pairs:
                ids = np.asarray(dr.blocks[0])
                tokens = np.arange(dr.prompt_len)
                got = kv[ids[tokens // BLOCK], :, tokens % BLOCK]  # [token, K|V, head, channel]
                for stream in (0, 1):
                    want = mix(
                        layer,
                        stream,
                        tokens[:, None, None],
                        np.arange(first_head, first_head + heads)[None, :, None],
                        np.arange(HEAD_SIZE)[None, None, :],
                        request_salt(dr.id),
                    ).astype(np.int16)
                    wrong = np.argwhere(got[:, stream] != want)
                    assert wrong.size == 0, (
                        f"{dr.id} layer {layer} {'KV'[stream]} on decode rank {rank}: "
                        f"{len(wrong)} elements differ, first at (token, head, channel) "
                        f"{wrong[0].tolist()}"
                    )
