"""Which blocks the worker zeroes: those vLLM just handed a request that nothing of it was
written to, on vLLM's own ``SchedulerOutput`` records. A hit's full blocks and a load's
partly filled last block keep their bytes (zeroing them would lose KV), every other new block
is zeroed (or a tail's page would file its previous owner's bytes). The bytes themselves are
checked on real engines in test_pool_e2e (a stored tail page holds its tokens and zeros)."""

from __future__ import annotations

import torch
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

from app.connectors.vllm.fresh_blocks import FreshBlocks, zero_blocks

BS = 16


def new(rid: str, blocks: list[int], computed: int) -> NewRequestData:
    return NewRequestData(rid, [], [], None, None, (blocks,), computed, None)


Grown = tuple[list[int], ...] | None


def output(
    news: list[NewRequestData],
    cached: tuple[tuple[str, Grown, int], ...] = (),
    resumed: frozenset[str] = frozenset(),
) -> SchedulerOutput:
    data = CachedRequestData.make_empty()
    for rid, grown, computed in cached:
        data.req_ids.append(rid)
        data.new_block_ids.append(grown)
        data.num_computed_tokens.append(computed)
        data.num_output_tokens.append(0)
    data.resumed_req_ids = set(resumed)
    return SchedulerOutput(
        scheduled_new_reqs=news,
        scheduled_cached_reqs=data,
        num_scheduled_tokens={},
        total_num_scheduled_tokens=0,
        scheduled_spec_decode_tokens={},
        scheduled_encoder_inputs={},
        finished_req_ids=set(),
        free_encoder_mm_hashes=[],
    )


def test_a_new_request_keeps_its_hit_and_zeroes_the_rest() -> None:
    fresh = FreshBlocks([BS])
    fresh.hit("a", 2 * BS)
    fresh.allocated("a", [[7, 8, 9, 10]], 0)  # computed here: taken when scheduled
    assert fresh.take() == [[]]
    fresh.scheduled(output([new("a", [7, 8, 9, 10], 2 * BS)]))
    assert fresh.take() == [[9, 10]]
    assert fresh.take() == [[]], "taken once"


def test_an_async_load_zeroes_at_allocation_and_keeps_what_landed() -> None:
    fresh = FreshBlocks([BS])
    fresh.hit("d", BS)
    fresh.allocated("d", [[3, 4, 5]], BS + 5)  # the load fills block 4 and 5 tokens of 5
    assert fresh.take() == [[4, 5]]
    # Scheduled once the load landed: 2 blocks and 5 tokens computed; block 5 holds the
    # loaded 5 (not zeroed), block 6 is new.
    fresh.scheduled(output([new("d", [3, 4, 5, 6], 2 * BS + 5)]))
    assert fresh.take() == [[6]]


def test_running_requests_zero_their_new_blocks_and_a_resumed_one_its_uncomputed() -> None:
    fresh = FreshBlocks([BS, 2 * BS])  # two groups, two block sizes
    cached = (
        ("r", ([11], [21]), 40),  # a running request's new blocks: fresh
        ("idle", None, 9),
        ("back", ([1, 2, 3], [4, 5]), BS + 1),  # resumed: its whole table, 17 computed
    )
    fresh.scheduled(output([], cached, frozenset({"back"})))
    assert fresh.take() == [[11, 3], [21, 5]]


def test_zero_blocks_clears_whole_pages_of_attention_groups_only() -> None:
    kv = torch.full((8, 2, 4, 3), 7.0)  # 4 blocks of 2 kernel blocks each
    other = torch.full((4, 2, 8, 3), 5.0)
    zero_blocks({0: [(kv, 2)], 1: []}, [[2, 0], [1]])
    assert torch.equal(kv[4:6], torch.zeros(2, 2, 4, 3)), "block 2's two kernel blocks"
    assert (kv[:4] == 7).all() and (kv[6:] == 7).all(), "others, and the null block, kept"
    assert (other == 5).all()
