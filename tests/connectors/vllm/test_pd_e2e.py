"""Decode output after a layer-wise push equals the engine's own output without a transfer.

Catches: KV written to the wrong blocks/layers/heads or groups (decode would generate other
tokens), a transfer that silently did not happen (decode would compute the whole prompt: the
local_compute counter), a sliding window sent from the wrong blocks (gemma3, prompts longer
than the 64-token window), a partial last block lost (lengths not a multiple of the block size).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from app.connectors.vllm.local_pd import LocalPD
from tests.connectors.vllm.conftest import group_counters, prompt, prompt_tokens_by_source

LENGTHS = (37, 130, 300, 700)
MAX_TOKENS = 8


def test_decode_equals_reference(pd: LocalPD) -> None:
    prompts = [prompt(n, i) for i, n in enumerate(LENGTHS)]
    # The reference: the prefill engine itself, no transfer involved.
    reference = [pd.complete(pd.prefill.url, p, MAX_TOKENS) for p in prompts]
    assert len({tuple(r) for r in reference}) == len(prompts), "tiny model is not distinctive"
    before = prompt_tokens_by_source(pd.decode.url)
    d_before = group_counters(pd.decode.admin)
    p_before = group_counters(pd.prefill.admin)

    with ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(lambda p: pd.complete(pd.proxy, p, MAX_TOKENS), prompts))

    assert got == reference
    after = prompt_tokens_by_source(pd.decode.url)
    # Decode computed exactly the one token per prompt the protocol leaves to it.
    assert after.get("local_compute", 0) - before.get("local_compute", 0) == len(prompts)
    assert after.get("external_kv_transfer", 0) - before.get("external_kv_transfer", 0) == sum(
        n - 1 for n in LENGTHS
    )
    # Every group of every request completed at decode, and prefill wrote bytes for each.
    for b, a in zip(d_before, group_counters(pd.decode.admin), strict=True):
        assert a["done"] - b["done"] == len(prompts), a
    for b, a in zip(p_before, group_counters(pd.prefill.admin), strict=True):
        assert a["bytes"] > b["bytes"], a
