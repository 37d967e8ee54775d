"""A pick's ``cost_tokens`` with a pool hit: what is left to compute of the prompt there.

The prefill computes ``prompt + 1`` tokens (it generates one) less what its own cache holds,
and loads from the pool what the pool holds beyond that, each loaded token costing
``load_cost`` of a computed one (pool_tier.py's docstring, README "The pool as second tier"):

    cost = prompt + 1 - engine_hit - extra + load_cost * extra,  extra = pool_hit - engine_hit

The expected values below are worked out from that, not from the code's helpers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from tests.proxy.conftest import Cluster
from tests.proxy.test_pool_tier import A, FakePool


@pytest.fixture
def fake_pool() -> Iterator[FakePool]:
    fake = FakePool()
    yield fake
    fake.server.stop()


def pick_of(c: Cluster, prompt: list[int]) -> dict[str, object]:
    r = c.post(prompt=prompt, max_tokens=1)
    assert r.status_code == 200, r.text
    return dict(c.record(r.headers["x-kv-transfer-id"])["prefill_pick"])


def test_cost_tokens_is_what_is_left_to_compute_after_the_engine_and_the_pool(
    make_cluster: Callable[..., Cluster], fake_pool: FakePool
) -> None:
    fake_pool.holds = [A]  # 1088 tokens; asked 1087, it serves 8 blocks of 128: 1024
    c = make_cluster().start_proxy(
        prefill_policy="cache_aware", pool_lookup=fake_pool.server.url, pool_load_cost=0.25
    )
    # Nothing in the engine: 1089 - 0 - 1024 + 0.25 * 1024 = 321.
    first = pick_of(c, A)
    assert (first["hit_tokens"], first["pool_hit_tokens"], first["hit_tier"]) == (0, 1024, "pool")
    assert first["cost_tokens"] == 321
    # The engine now holds A's first 640 tokens (40 blocks of 16 the proxy routed there): the
    # pool adds 384 beyond them, so 1089 - 640 - 384 + 0.25 * 384 = 161.
    c2 = make_cluster().start_proxy(
        prefill_policy="cache_aware", pool_lookup=fake_pool.server.url, pool_load_cost=0.25
    )
    fake_pool.holds = []
    assert pick_of(c2, A[:640])["pool_hit_tokens"] == 0
    fake_pool.holds = [A]
    second = pick_of(c2, A)
    assert (second["hit_tokens"], second["pool_hit_tokens"]) == (640, 1024)
    assert second["cost_tokens"] == 161
    # A pool that holds less than the engine adds nothing: a prompt sharing A's first 640
    # tokens, which the first proxy sent to its engine, and the pool 512: 1089 - 640 = 449.
    fake_pool.holds = [A[:512]]
    less = pick_of(c, [*A[:640], *range(9000, 9448)])
    assert (less["hit_tokens"], less["pool_hit_tokens"], less["hit_tier"]) == (640, 512, "engine")
    assert less["cost_tokens"] == 449
