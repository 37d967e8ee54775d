"""A send admitted without a target pins prefill's blocks until decode answers: how long it may
wait is the operator's to bound, whatever a request asks, and how many may wait per rank too."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator

import pytest

from app.kvcache.desc import LayoutDesc
from app.transfer.wire.protocol import AddSend, Reply, Status
from tests.transfer.conftest import PROMPT_DIGEST, Prefill, ids, make_prefill, send_settings


def _held(
    rid: str, target_timeout_s: float | None = None, blocks: tuple[int, ...] = (7, 8, 9)
) -> AddSend:
    return AddSend(
        rank=0,
        request=rid,
        prompt_len=40,
        block_ids=ids(list(blocks)),
        target_timeout_s=target_timeout_s,
        prompt_digest=PROMPT_DIGEST,
    )


@pytest.fixture
async def limited(layout: LayoutDesc) -> AsyncIterator[Prefill]:
    limits = dataclasses.replace(
        send_settings(), max_target_timeout_s=20.0, max_held_sends=2, max_held_blocks=5
    )
    p = make_prefill(layout, settings=limits)
    yield p
    await p.tasks.cancel()


async def test_target_wait_is_clamped_to_the_operators_maximum(limited: Prefill) -> None:
    await limited.side.add(_held("asks-an-hour", 3600.0))
    assert limited.req("asks-an-hour").deadline == limited.clock.now + 20.0
    limited.req("asks-an-hour").finish(Status.FAILED)
    await limited.side.add(_held("asks-5s", 5.0))
    assert limited.req("asks-5s").deadline == limited.clock.now + 5.0


async def test_held_sends_over_the_block_or_count_cap_are_refused(limited: Prefill) -> None:
    assert await limited.side.add(_held("a")) == Reply()
    over_blocks = await limited.side.add(_held("b"))  # 3 + 3 blocks > 5
    assert isinstance(over_blocks, Reply) and not over_blocks.ok
    assert "would pin 6 blocks" in (over_blocks.error or "")
    # A send that comes with its target holds nothing: these caps never refuse it.
    assert await limited.add("with-target") == Reply()
    assert await limited.side.add(_held("c", 1.0)) != Reply()  # still over the block cap
    limited.req("a").finish(Status.ABORTED)  # no longer held
    assert await limited.side.add(_held("d")) == Reply()


async def test_held_sends_over_the_count_cap_are_refused(layout: LayoutDesc) -> None:
    p = make_prefill(layout, settings=dataclasses.replace(send_settings(), max_held_sends=1))
    try:
        assert await p.side.add(_held("a")) == Reply()
        over = await p.side.add(_held("b"))
        assert isinstance(over, Reply) and "max_held_sends=1" in (over.error or "")
    finally:
        await p.tasks.cancel()


async def test_held_sends_pinning_exactly_the_block_cap_are_admitted(layout: LayoutDesc) -> None:
    """The cap is the most that may be pinned, not the first count refused: 3 + 2 blocks under
    ``max_held_blocks=5`` are admitted, one block more is not."""
    p = make_prefill(layout, settings=dataclasses.replace(send_settings(), max_held_blocks=5))
    try:
        assert await p.side.add(_held("a")) == Reply()
        assert await p.side.add(_held("b", blocks=(10, 11))) == Reply()  # exactly 5 pinned
        over = await p.side.add(_held("c", blocks=(12,)))
        assert isinstance(over, Reply) and "would pin 6 blocks" in (over.error or ""), over
    finally:
        await p.tasks.cancel()
