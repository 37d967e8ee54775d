"""A pool lookup's answer is used only when it can be true: a whole number of tokens from 0 to
what was asked less its last token. Anything else (longer than the prompt, below
0, not an integer) is refused as unusable, and the pick goes without the pool and says why."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from tests.proxy.conftest import Cluster
from tests.proxy.test_pool_tier import A, FakePool

ASKED = len(A) - 1  # the most a lookup of A may hit: the engine computes the last token


@pytest.fixture
def fake_pool() -> Iterator[FakePool]:
    fake = FakePool()
    yield fake
    fake.server.stop()


def pool_pick(c: Cluster) -> tuple[object, object]:
    r = c.post(prompt=A, max_tokens=1)
    assert r.status_code == 200, r.text
    pick = c.record(r.headers["x-kv-transfer-id"])["prefill_pick"]
    return pick["pool_hit_tokens"], pick["pool_note"]


def test_an_answer_longer_than_the_prompt_is_refused_as_unusable(
    make_cluster: Callable[..., Cluster], fake_pool: FakePool
) -> None:
    c = make_cluster().start_proxy(prefill_policy="cache_aware", pool_lookup=fake_pool.server.url)
    for bad in (ASKED + 1, len(A) + 1, 10 * len(A), -1, True, 512.0, "512", None):
        fake_pool.forced = bad if bad is not None else "null"
        hit, note = pool_pick(c)
        assert hit == 0, bad
        assert note == f"pool lookup answered an unusable hit: {fake_pool.forced!r}", bad
    assert fake_pool.asked[-1] == A  # the whole prompt, as the connector asks
    # The boundaries themselves are usable: the whole question, and nothing.
    for good in (ASKED, 0):
        fake_pool.forced = good
        assert pool_pick(c) == (good, None)
