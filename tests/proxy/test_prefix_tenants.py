"""The proxy's approximate prefix chains are keyed by tenant (issue 50, item 5): a chain starts
from a root naming the request's ``cache_salt`` and its ``model`` (a LoRA adapter's name, or
the base model's), as vLLM keys both into its block hashes. So the same prompt under another
salt or adapter shares no block with it, and a salted request is never scored on another
tenant's prompts, in token ids, text or chat."""

from __future__ import annotations

from typing import Any

import pytest

from app.proxy import Policy
from app.proxy.balancer import Pool, Routing
from app.proxy.routing import PrefixIndex, shape_of

BS = 16
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
PROMPTS: dict[str, tuple[str, dict[str, Any]]] = {
    "token ids": (COMPLETIONS, {"prompt": list(range(320))}),
    "text": (COMPLETIONS, {"prompt": "the same words " * 100}),
    "chat": (CHAT, {"messages": [{"role": "user", "content": "the same words " * 100}]}),
}
TENANTS = [
    ({"model": "base"}, {"model": "base", "cache_salt": "tenant-b"}),  # unsalted vs salted
    ({"model": "base", "cache_salt": "a"}, {"model": "base", "cache_salt": "b"}),
    ({"model": "adapter-a"}, {"model": "adapter-b"}),  # two LoRA adapters, one prompt
]


def _chain(kind: str, tenant: dict[str, Any]) -> tuple[int, ...]:
    path, body = PROMPTS[kind]
    return shape_of({**body, **tenant}, path, BS).chain


@pytest.mark.parametrize("kind", list(PROMPTS))
@pytest.mark.parametrize(("a", "b"), TENANTS)
def test_one_prompt_under_two_tenants_shares_no_block(
    kind: str, a: dict[str, Any], b: dict[str, Any]
) -> None:
    mine, theirs = _chain(kind, a), _chain(kind, b)
    assert len(mine) == len(theirs) > 0
    assert not set(mine) & set(theirs)
    index = PrefixIndex(capacity=1000)
    index.add(mine)
    assert index.hit_blocks(theirs) == 0
    assert index.hit_blocks(_chain(kind, dict(a))) == len(mine)  # the same tenant hits


def test_a_salted_request_is_not_routed_by_another_tenants_prompt() -> None:
    """cache_aware: tenant A's prompt went to p0. Tenant B's same prompt scores no hit there
    (its pick tells nothing of A's prompts), while A's own again hits all of it."""
    pool = Pool("prefill", ["http://p0", "http://p1"], Routing(Policy.CACHE_AWARE, alpha=1.0))
    for inst in pool.instances:
        inst.mark(True)
    body = {"prompt": list(range(320)), "model": "base"}
    first = pool.acquire(shape_of({**body, "cache_salt": "a"}, COMPLETIONS, BS))
    first.release()
    assert first.url == "http://p0"
    other = pool.acquire(shape_of({**body, "cache_salt": "b"}, COMPLETIONS, BS))
    other.release()
    assert other.pick is not None and other.pick.hit_tokens == 0
    again = pool.acquire(shape_of({**body, "cache_salt": "a"}, COMPLETIONS, BS))
    assert again.url == "http://p0"
    assert again.pick is not None and again.pick.hit_tokens == 320
