"""Cache-hit length across KV cache groups: worked examples and properties."""

from __future__ import annotations

import math
from functools import reduce

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from app.errors import ConfigError
from app.store.coordinator import (
    PoolCoordinator,
    PoolGroup,
    find_longest_cache_hit,
    group_rule_holds,
)


def hits(n: int, *, missing: tuple[int, ...] = ()) -> list[bool]:
    """``n`` block hits with the given indices missing."""
    return [i not in missing for i in range(n)]


def indices(mask: tuple[bool, ...]) -> tuple[int, ...]:
    return tuple(i for i, m in enumerate(mask) if m)


FULL4 = PoolGroup("full_attention", 4)
SW4_W8 = PoolGroup("sliding_window", 4, sliding_window=8)  # needs 2 blocks


# ------------------------------------------------------------------------ worked examples


def test_full_plus_sliding_with_a_hole_lands_before_the_hole() -> None:
    # 41 tokens: at most 40 reusable = 10 blocks of 4. The sliding group misses block 8, so
    # the last window of 2 contiguous hits ends at block 7 -> 32 tokens.
    r = find_longest_cache_hit([FULL4, SW4_W8], [hits(10), hits(10, missing=(8,))], 41)
    assert r.hit_tokens == 32
    assert indices(r.load_masks[0]) == tuple(range(8))
    assert indices(r.load_masks[1]) == (6, 7)  # only the window tail is loaded


def test_hole_outside_the_window_does_not_matter() -> None:
    r = find_longest_cache_hit([FULL4, SW4_W8], [hits(10), hits(10, missing=(1, 2, 5))], 41)
    assert r.hit_tokens == 40
    assert indices(r.load_masks[1]) == (8, 9)


def test_run_touching_block_zero_is_a_hit_even_if_shorter_than_the_window() -> None:
    sw = PoolGroup("sliding_window", 4, sliding_window=17)  # needs 4 blocks
    r = find_longest_cache_hit([FULL4, sw], [hits(10), hits(10, missing=(3, 6))], 41)
    # No run of 4 anywhere; blocks 0..2 hit: a run from block 0 of 3 blocks still counts.
    assert r.hit_tokens == 12
    assert indices(r.load_masks[1]) == (0, 1, 2)


def test_hit_is_capped_at_num_tokens_minus_one() -> None:
    # 40 tokens, every block pooled: the last token is recomputed, so the last block is too.
    r = find_longest_cache_hit([FULL4], [hits(10)], 40)
    assert r.hit_tokens == 36
    assert find_longest_cache_hit([FULL4], [hits(10)], 0).hit_tokens == 0
    assert find_longest_cache_hit([FULL4], [hits(10)], 1).hit_tokens == 0


def test_deepseek_v4_like_five_groups() -> None:
    # MLA latent (64), sliding window (64, w=128) twice -- identical specs, merged -- and two
    # compressed full-attention groups whose blocks cover 256 and 128 tokens. lcm = 256.
    groups = [
        PoolGroup("mla", 64),
        PoolGroup("sliding_window", 64, sliding_window=128),
        PoolGroup("full_attention", 256),
        PoolGroup("sliding_window", 64, sliding_window=128),
        PoolGroup("full_attention", 128),
    ]
    coord = PoolCoordinator(groups)
    assert coord.lcm_block_size == 256 and coord.hash_block_size == 64
    assert sorted(coord.spec_group_ids) == [(0,), (1, 3), (2,), (4,)]
    masks = [
        hits(31),
        hits(31, missing=(23,)),
        hits(7),
        hits(31, missing=(27,)),
        hits(15),
    ]
    r = coord.find_longest_cache_hit(masks, 2000)
    # Full attention allows 1792 (28 blocks of 64, aligned to 256). The merged sliding mask
    # misses 23 and 27; the right-most 2-block run ending on a 256 boundary ends at 1280.
    assert r.hit_tokens == 1280
    assert r.iterations == 2  # full attention had to be cut on a second pass
    assert indices(r.load_masks[0]) == tuple(range(20))
    assert indices(r.load_masks[1]) == (18, 19)
    assert indices(r.load_masks[2]) == tuple(range(5))
    assert indices(r.load_masks[3]) == (18, 19)
    assert indices(r.load_masks[4]) == tuple(range(10))


def test_merged_groups_need_the_block_in_every_member() -> None:
    a = PoolGroup("full_attention", 4)
    r = find_longest_cache_hit([a, a], [hits(10), hits(10, missing=(4,))], 41)
    assert r.hit_tokens == 16


def test_mamba_align_hybrid_takes_the_right_most_aligned_state() -> None:
    # Full attention in blocks of 4, Mamba state every 16 tokens: lcm 16.
    mamba = PoolGroup("mamba", 16)
    r = find_longest_cache_hit(
        [FULL4, mamba], [hits(40), [True, False, True, False, False, False]], 100
    )
    # Full attention allows 96; the latest pooled state at or before 96 ends at 48.
    assert r.hit_tokens == 48
    assert indices(r.load_masks[0]) == tuple(range(12))
    assert indices(r.load_masks[1]) == (2,)  # only the state block at the hit


def test_mamba_cuts_full_attention_and_sliding_window_to_a_fixed_point() -> None:
    mamba = PoolGroup("mamba", 8)
    sw = PoolGroup("sliding_window", 4, sliding_window=5)  # needs 1 block
    masks = [hits(20), hits(20, missing=(9,)), [False, False, True, False, False, True]]
    r = find_longest_cache_hit([FULL4, sw, mamba], masks, 60)
    # full: 56; sliding: 56; mamba at 56 -> state at 48; sliding at 48 -> needs block 11 -> 48.
    assert r.hit_tokens == 48
    assert r.iterations == 2
    assert indices(r.load_masks[2]) == (5,)


def test_chunked_local_attention_reads_only_the_current_chunk() -> None:
    chunked = PoolGroup("chunked_local", 16, attention_chunk_size=64)
    full = PoolGroup("full_attention", 16)
    # 100 tokens -> at most 96 = 6 blocks; chunk of 96 starts at 64 (block 4).
    r = find_longest_cache_hit([full, chunked], [hits(6), hits(6, missing=(0, 1, 2))], 100)
    assert r.hit_tokens == 96
    assert indices(r.load_masks[1]) == (4, 5)
    # Block 5 missing: resume at 80 (chunk start 64, block 4 pooled).
    r = find_longest_cache_hit([full, chunked], [hits(6), hits(6, missing=(5,))], 100)
    assert r.hit_tokens == 80
    assert indices(r.load_masks[1]) == (4,)


def test_eagle_drops_one_block() -> None:
    r = find_longest_cache_hit([FULL4], [hits(10)], 41, use_eagle=True)
    assert r.hit_tokens == 36
    r = find_longest_cache_hit([FULL4, SW4_W8], [hits(10), hits(10)], 41, use_eagle=True)
    assert r.hit_tokens == 36
    assert indices(r.load_masks[1]) == (7, 8)


def test_eagle_drops_once_per_candidate_length() -> None:
    # full + sliding (1 block) + Mamba, EAGLE. Pass 1: full 40 -> 36 (drop), sliding 36 (its
    # run of 2 ends at block 9, one dropped), Mamba cuts to 24. Mamba is an EAGLE group too
    # (vLLM counts every group when none is flagged), so its cut does not clear the sliding
    # group's verification: pass 2 checks sliding at 24 without a drop and settles.
    sw = PoolGroup("sliding_window", 4, sliding_window=5)
    mamba = PoolGroup("mamba", 4)
    mamba_mask = hits(10, missing=(0, 1, 2, 3, 4, 6, 7, 8, 9))
    r = find_longest_cache_hit(
        [FULL4, sw, mamba], [hits(10), hits(10), mamba_mask], 41, use_eagle=True
    )
    assert r.hit_tokens == 24
    assert r.iterations == 2


def test_a_mamba_cut_does_not_make_eagle_groups_drop_again() -> None:
    # As above, but the sliding group misses block 6 and Mamba holds states at 16 and 24.
    # vLLM verified the sliding drop at 40 and Mamba, an EAGLE group itself, cut to 24 without
    # clearing that: pass 2 checks sliding at 24 with no drop (block 5 suffices) -> 24. (This
    # used to re-apply the drop at 24 and settle on 16; vLLM 0.32 does not.)
    sw = PoolGroup("sliding_window", 4, sliding_window=5)
    mamba = PoolGroup("mamba", 4)
    masks = [hits(10), hits(10, missing=(6,)), hits(10, missing=(0, 1, 2, 4, 6, 7, 8, 9))]
    r = find_longest_cache_hit([FULL4, sw, mamba], masks, 41, use_eagle=True)
    assert r.hit_tokens == 24
    assert r.iterations == 2


def test_eagle_drop_is_applied_again_after_a_non_eagle_group_moves_the_candidate() -> None:
    # Same pool, but only the attention groups are the drafter's: Mamba's cut to 24 clears the
    # verifications, so sliding drops again there (its run then needs blocks 5 and 6): 20,
    # Mamba 16; pass 3 settles on 16.
    sw = PoolGroup("sliding_window", 4, sliding_window=5)
    mamba = PoolGroup("mamba", 4)
    masks = [hits(10), hits(10, missing=(6,)), hits(10, missing=(0, 1, 2, 4, 6, 7, 8, 9))]
    coord = PoolCoordinator([FULL4, sw, mamba], use_eagle=True, eagle_group_ids=(0, 1))
    r = coord.find_longest_cache_hit(masks, 41)
    assert r.hit_tokens == 16
    assert r.iterations == 3


def test_eagle_look_ahead_needs_two_groups() -> None:
    # 32 tokens, every block pooled. One group (vLLM's unitary coordinator) looks up to 31
    # tokens: one block, dropped -> 0. Two groups look one block past the candidate, up to the
    # request's last whole hash block (32): two blocks, one dropped -> 16.
    full16 = PoolGroup("full_attention", 16)
    assert find_longest_cache_hit([full16], [hits(2)], 32, use_eagle=True).hit_tokens == 0
    r = find_longest_cache_hit([full16, full16], [hits(2), hits(2)], 32, use_eagle=True)
    assert r.hit_tokens == 16


def test_eagle_sliding_run_from_block_zero_aligns_drops_and_aligns_again() -> None:
    # Sliding window in blocks of 4 next to full attention in blocks of 8 (lcm 8); the window
    # needs 4 blocks (+1 with EAGLE) and only blocks 0..2 are pooled. The run from block 0 is
    # 3 blocks: aligned to 2 (8 tokens), one dropped (1), aligned again -> 0.
    sw = PoolGroup("sliding_window", 4, sliding_window=17)
    full8 = PoolGroup("full_attention", 8)
    masks = [hits(5), hits(10, missing=tuple(range(3, 10)))]
    assert find_longest_cache_hit([full8, sw], masks, 41, use_eagle=True).hit_tokens == 0
    # Without EAGLE the same run gives its aligned 8 tokens.
    assert find_longest_cache_hit([full8, sw], masks, 41).hit_tokens == 8


def test_chunked_local_needs_the_lcm_block_size() -> None:
    # vLLM asserts a chunked-local group's block size is the hit alignment; so do we.
    chunked = PoolGroup("chunked_local", 4, attention_chunk_size=16)
    with pytest.raises(ConfigError, match="chunked local"):
        PoolCoordinator([PoolGroup("full_attention", 8), chunked])


def test_eagle_with_chunked_local_is_refused() -> None:
    chunked = PoolGroup("chunked_local", 16, attention_chunk_size=64)
    with pytest.raises(ConfigError, match="chunked local"):
        PoolCoordinator([FULL4, chunked], use_eagle=True)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"kind": "sliding_window", "block_size": 16}, "sliding_window >= 2"),
        ({"kind": "full_attention", "block_size": 0}, "positive"),
        ({"kind": "chunked_local", "block_size": 16, "attention_chunk_size": 24}, "multiple"),
        ({"kind": "full_attention", "block_size": 16, "sliding_window": 8}, "only meaningful"),
        ({"kind": "linear", "block_size": 16}, "unknown group kind"),
    ],
)
def test_bad_group_specs_are_refused(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        PoolGroup(**kwargs)  # type: ignore[arg-type]


# ------------------------------------------------------------------------ store masks


def test_store_masks_follow_the_seed_pr() -> None:
    mamba = PoolGroup("mamba", 16)
    coord = PoolCoordinator([FULL4, SW4_W8, mamba])
    masks = coord.store_masks(70)  # cacheable: 64 tokens (lcm 16)
    assert indices(masks[0]) == tuple(range(16))  # full: every block up to 64
    assert len(masks[0]) == 17  # 17 full blocks computed; block 16 is past the cacheable prefix
    assert indices(masks[1]) == (14, 15)  # sliding: the window tail only
    assert indices(masks[2]) == (3,)  # Mamba: the state at 64 only


def test_store_masks_with_eagle_add_the_lookahead_block() -> None:
    coord = PoolCoordinator([FULL4, SW4_W8, PoolGroup("mamba", 16)], use_eagle=True)
    masks = coord.store_masks(53)  # cacheable 48 (lcm 16); block 12 of the 4-token groups is full
    assert indices(masks[0]) == tuple(range(13))
    assert indices(masks[1]) == (10, 11, 12)
    assert indices(masks[2]) == (2,)  # Mamba looks no block ahead, so it stores none
    # What was stored is enough for an EAGLE lookup of a longer prompt to hit all of it...
    assert coord.find_longest_cache_hit(masks, 70).hit_tokens == 48
    # ...and without the lookahead block nothing hits: full attention falls to 32, where no
    # window tail or Mamba state was stored.
    trimmed = (masks[0][:12], masks[1][:12], masks[2])
    assert coord.find_longest_cache_hit(trimmed, 70).hit_tokens == 0


# ------------------------------------------------------------------------ properties

KIND_SPECS = st.sampled_from(
    [
        ("full_attention", None, None),
        ("mla", None, None),
        ("sliding_window", 5, None),
        ("sliding_window", 17, None),
        ("sliding_window", 2, None),
        ("chunked_local", None, 2),
        ("mamba", None, None),
    ]
)


@st.composite
def scenarios(draw: st.DrawFn, allow_eagle: bool = True) -> tuple:
    n_groups = draw(st.integers(1, 4))
    kinds = [draw(KIND_SPECS) for _ in range(n_groups)]
    sizes = [draw(st.sampled_from([4, 8, 16])) for _ in range(n_groups)]
    groups: list[PoolGroup] = []
    for (kind, window, chunk_blocks), bs in zip(kinds, sizes, strict=True):
        if kind == "chunked_local":
            # vLLM supports chunked local attention only with the lcm block size.
            bs = reduce(math.lcm, sizes)
        groups.append(
            PoolGroup(
                kind,  # type: ignore[arg-type]
                bs,
                sliding_window=window,
                attention_chunk_size=None if chunk_blocks is None else chunk_blocks * bs,
            )
        )
    num_tokens = draw(st.integers(0, 160))
    masks = [
        draw(
            st.lists(
                st.booleans(),
                min_size=num_tokens // g.block_size,
                max_size=num_tokens // g.block_size,
            )
        )
        for g in groups
    ]
    has_chunked = any(g.kind == "chunked_local" for g in groups)
    eagle = allow_eagle and not has_chunked and draw(st.booleans())
    return groups, masks, num_tokens, eagle


def brute_force(groups: list[PoolGroup], masks: list[list[bool]], num_tokens: int) -> int:
    lcm = reduce(math.lcm, (g.block_size for g in groups))
    top = max(0, num_tokens - 1) // lcm * lcm
    for length in range(top, -1, -lcm):
        if all(group_rule_holds(g, m, length) for g, m in zip(groups, masks, strict=True)):
            return length
    return 0


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_hit_is_capped_aligned_and_every_rule_holds(case: tuple) -> None:
    groups, masks, num_tokens, eagle = case
    coord = PoolCoordinator(groups, use_eagle=eagle)
    r = coord.find_longest_cache_hit(masks, num_tokens)
    assert 0 <= r.hit_tokens <= max(0, num_tokens - 1)
    assert r.hit_tokens % coord.lcm_block_size == 0
    for g, m in zip(groups, masks, strict=True):
        assert group_rule_holds(g, m, r.hit_tokens)
    # A load never asks for a block the pool does not hold.
    for m, load in zip(masks, r.load_masks, strict=True):
        assert all(m[i] for i, want in enumerate(load) if want)


@settings(max_examples=200, deadline=None)
@given(scenarios(allow_eagle=False))
def test_hit_is_the_longest_length_every_group_accepts(case: tuple) -> None:
    groups, masks, num_tokens, _ = case
    r = find_longest_cache_hit(groups, masks, num_tokens)
    assert r.hit_tokens == brute_force(groups, masks, num_tokens)


@settings(max_examples=100, deadline=None)
@given(scenarios(allow_eagle=False))
def test_hit_is_a_fixed_point(case: tuple) -> None:
    groups, masks, num_tokens, _ = case
    coord = PoolCoordinator(groups)
    hit = coord.find_longest_cache_hit(masks, num_tokens).hit_tokens
    # Asking again with exactly the hit as the limit gives the hit back.
    assert coord.find_longest_cache_hit(masks, hit + 1).hit_tokens == hit


@settings(max_examples=100, deadline=None)
@given(scenarios(allow_eagle=False))
def test_storing_the_store_masks_makes_the_prefix_hit(case: tuple) -> None:
    groups, _, num_tokens, _ = case
    coord = PoolCoordinator(groups)
    stored = coord.store_masks(num_tokens)
    # A later request extending this prompt, against a pool holding only what was stored.
    later = coord.find_longest_cache_hit(stored, num_tokens + 1)
    assert later.hit_tokens == coord.cacheable_tokens(num_tokens)


@settings(max_examples=100, deadline=None)
@given(
    st.sampled_from([4, 8, 16]),
    st.lists(st.booleans(), max_size=40),
    st.data(),
)
def test_full_attention_only_is_monotone_in_hits(
    bs: int, mask: list[bool], data: st.DataObject
) -> None:
    group = PoolGroup("full_attention", bs)
    num_tokens = data.draw(st.integers(0, len(mask) * bs + bs))
    extra = data.draw(st.lists(st.integers(0, max(0, len(mask) - 1)), max_size=10))
    more = list(mask)
    for i in extra:
        if more:
            more[i] = True
    for eagle in (False, True):
        coord = PoolCoordinator([group], use_eagle=eagle)
        before = coord.find_longest_cache_hit([mask], num_tokens).hit_tokens
        after = coord.find_longest_cache_hit([more], num_tokens).hit_tokens
        assert after >= before
