"""The engine's hit from the index's groups, checked against vLLM's own hybrid KV cache manager
(full attention + a sliding window, a sliding-window group missing middle blocks after eviction)
and, for Mamba and the refusals, against hand-built groups."""

from __future__ import annotations

import pytest

from app.proxy.kv_events import GroupHit, GroupId, InstanceIndex, KeyScheme, engine_hit
from app.store.coordinator import PoolGroup, find_longest_cache_hit
from tests.proxy.kv_events.engine import CacheEngine, full_attention, prompt, sliding_window

GPU = "GPU"


def vllm_hit(engine: CacheEngine, tokens: list[int]) -> int:
    """vLLM's own answer: the computed tokens its scheduler would skip for this prompt."""
    _, hit, _ = engine.manager.get_computed_blocks(engine.request(tokens))
    return int(hit)


@pytest.fixture(scope="module")
def hybrid() -> tuple[CacheEngine, InstanceIndex, list[int]]:
    """A served 10-block prompt whose window group (32 tokens: 2 blocks) lost blocks 1..3.

    Prefilled in two steps, the window group frees blocks 0..3 mid-request (outside the window);
    they go to the free queue before the rest, so the next prompt evicts 1..3 of them first."""
    engine = CacheEngine(num_blocks=24, groups=[full_attention(16), sliding_window(32, 16)])
    index = InstanceIndex(KeyScheme.new(16))
    a = prompt(160, 1)
    engine.serve_with_window_gap(a, 96)
    index.apply(0, engine.take())
    engine.serve(prompt(48, 2))
    index.apply(1, engine.take())
    assert index.consistent
    return engine, index, a


def test_the_window_group_cuts_the_full_attention_prefix_as_vllm_does(
    hybrid: tuple[CacheEngine, InstanceIndex, list[int]],
) -> None:
    engine, index, a = hybrid
    differ = 0
    for n in range(0, 11):
        q = a[: 16 * n] + prompt(40, 3)
        hits = index.lookup(index.scheme.prompt(q))
        # The state the test is built for: the window group lacks blocks 1..3 only.
        assert hits[1].held == tuple(i < n and (i == 0 or i >= 4) for i in range(n + 2))
        got = engine_hit(hits, len(q))
        assert got.tokens == vllm_hit(engine, q), n
        if got.tokens != hits[0].tokens:
            differ += 1
            assert got.limited_by == GroupId(1, GPU)
    # Prompts sharing 2..5 blocks: full attention holds them all, the window only block 0.
    assert differ == 4


def test_a_hit_that_fits_is_limited_by_the_prompt_not_a_group(
    hybrid: tuple[CacheEngine, InstanceIndex, list[int]],
) -> None:
    engine, index, a = hybrid
    hits = index.lookup(index.scheme.prompt(a))
    got = engine_hit(hits, len(a))
    # 160 tokens: the last is recomputed, so 9 whole blocks are the most vLLM reuses.
    assert (got.tokens, got.limited_by) == (144, None) == (vllm_hit(engine, a), None)
    assert got.groups == ((GroupId(0, GPU), 144), (GroupId(1, GPU), 144))


def hit(group: int, kind: str | None, held: str, window: int | None = None) -> GroupHit:
    mask = tuple(c == "x" for c in held)
    lead = mask.index(False) if False in mask else len(mask)
    return GroupHit(GroupId(group, GPU), kind, window, 16, lead, mask)


def test_mamba_needs_the_state_block_at_the_hit() -> None:
    hits = [hit(0, "full_attention", "xxxxxx"), hit(1, "mamba", "x.x...")]
    got = engine_hit(hits, 100)
    groups = [PoolGroup("full_attention", 16), PoolGroup("mamba", 16)]
    expected = find_longest_cache_hit(groups, [h.held for h in hits], 100).hit_tokens
    assert got.tokens == expected == 48
    assert got.limited_by == GroupId(1, GPU)
    assert got.groups == ((GroupId(0, GPU), 96), (GroupId(1, GPU), 48))


def test_mla_and_sink_kinds_score_as_full_attention() -> None:
    hits = [hit(0, "mla_attention", "xxx..."), hit(1, "sink_full_attention", "xx....")]
    assert engine_hit(hits, 100).tokens == 32


@pytest.mark.parametrize("kind", ["chunked_local_attention", "unknown", None])
def test_a_kind_without_a_rule_scores_zero_and_says_why(kind: str | None) -> None:
    hits = [hit(0, "full_attention", "xxxx"), hit(1, kind, "xxxx")]
    got = engine_hit(hits, 100)
    assert (got.tokens, got.limited_by) == (0, GroupId(1, GPU))
    assert got.unsupported is not None and repr(kind) in got.unsupported


def test_a_group_that_stored_nothing_scores_zero() -> None:
    hits = [hit(0, "full_attention", "xxxx"), hit(2, "full_attention", "xxxx")]
    got = engine_hit(hits, 100)
    assert (got.tokens, got.limited_by) == (0, GroupId(1, GPU))
    got = engine_hit(hits[:1], 100, num_groups=2)
    assert (got.tokens, got.limited_by) == (0, GroupId(1, GPU))
    assert engine_hit(hits[:1], 100).tokens == 64


def test_mixed_media_are_refused() -> None:
    cpu = GroupHit(GroupId(0, "CPU"), "full_attention", None, 16, 1, (True,))
    with pytest.raises(ValueError, match="one medium"):
        engine_hit([hit(0, "full_attention", "x"), cpu], 100)
