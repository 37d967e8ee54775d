"""Stores never read a block the request no longer holds; loads never rewrite what the engine's
own cache hit put in place.

vLLM hands a sliding window's blocks behind the window back while a request runs (its
``remove_skipped_blocks``: the null block takes their place once ``computed - window + 1``
tokens lie behind), so a request that generated tokens, or whose long prompt was chunked, no
longer holds the window tail a hit at its whole prompt needs. Storing then read the null
block's page into the pool under the prefix's key, and a later hit loaded it: wrong answers
(issue 39). The held masks here are written from vLLM's rule, not from the coordinator's.
"""

from __future__ import annotations

import pytest

from app.store.coordinator import PoolCoordinator, PoolGroup

BS = 16
WINDOW = 24  # the tail a hit needs: cdiv(23, 16) = 2 blocks


def held_after(num_tokens_processed: int, num_blocks: int, window: int | None) -> list[bool]:
    """vLLM's sliding window: blocks wholly before ``processed - window + 1`` are freed."""
    if window is None:
        return [True] * num_blocks
    skipped = max(0, num_tokens_processed - window + 1)
    return [(i + 1) * BS > skipped for i in range(num_blocks)]


def hybrid() -> PoolCoordinator:
    return PoolCoordinator(
        [PoolGroup("full_attention", BS), PoolGroup("sliding_window", BS, sliding_window=WINDOW)]
    )


def test_a_prompt_that_still_holds_its_window_tail_stores_as_before() -> None:
    c = hybrid()
    prompt = 100  # 6 full blocks; processed 100 tokens: blocks from (100 - 23) // 16 = 4 held
    held = [held_after(prompt, 7, None), held_after(prompt, 7, WINDOW)]
    assert c.store_masks(prompt, held) == c.store_masks(prompt)
    full, window = c.store_masks(prompt, held)
    assert sum(full) == 6 and [i for i, m in enumerate(window) if m] == [4, 5]


def test_a_request_that_generated_past_its_window_tail_stores_nothing_it_lost() -> None:
    c = hybrid()
    prompt, generated = 100, 40
    held = [held_after(prompt + generated, 9, None), held_after(prompt + generated, 9, WINDOW)]
    assert not held[1][4], "the window tail of the prompt is gone (vLLM's rule)"
    full, window = c.store_masks(prompt, held)
    # No prefix of the prompt keeps its whole tail, so no hit could use any stored block.
    assert not any(window) and not any(full)


def test_the_longest_prefix_whose_tail_is_held_is_stored() -> None:
    # A wider window keeps older blocks: the whole prompt's tail is gone, an earlier one not.
    c = PoolCoordinator(
        [PoolGroup("full_attention", BS), PoolGroup("sliding_window", BS, sliding_window=40)]
    )
    held = [[True] * 6, [False, False, True, True, True, False]]  # block 5 nulled by hand
    full, window = c.store_masks(96, held)
    assert [i for i, m in enumerate(window) if m] == [2, 3, 4]  # the tail of 80 tokens
    assert [i for i, m in enumerate(full) if m] == [0, 1, 2, 3, 4]
    assert all(held[1][i] for i, m in enumerate(window) if m)


@pytest.mark.parametrize("held_tokens", [0, 16, 48, 64, 96])
def test_a_load_fetches_only_what_the_engines_own_hit_lacks(held_tokens: int) -> None:
    c = hybrid()
    hit = 96
    full, window = c.load_masks(hit, held_tokens)
    assert [i for i, m in enumerate(full) if m] == list(range(held_tokens // BS, hit // BS))
    # The window reads blocks 4 and 5 at 96; what the engine holds of them stays untouched.
    assert [i for i, m in enumerate(window) if m] == [i for i in (4, 5) if i >= held_tokens // BS]


def test_a_mamba_state_block_is_loaded_unless_held() -> None:
    c = PoolCoordinator([PoolGroup("full_attention", BS), PoolGroup("mamba", BS)])
    assert [i for i, m in enumerate(c.load_masks(64, 32)[1]) if m] == [3]
    assert not any(c.load_masks(64, 64)[1])
