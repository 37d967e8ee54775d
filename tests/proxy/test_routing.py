"""Routing: request shapes, the prefix index, the tokens and cache-aware policies."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest

from app.errors import ConfigError
from app.proxy import Policy, ProxyConfig
from app.proxy.balancer import Pool, Routing
from app.proxy.routing import PrefixIndex, shape_of
from tests.proxy.conftest import Cluster, wait_for

BS = 16


def ids(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def live_pool(role: str, policy: Policy, n: int = 2, alpha: float = 1.0) -> Pool:
    pool = Pool(role, [f"http://{role[0]}{i}" for i in range(n)], Routing(policy, alpha=alpha))
    for inst in pool.instances:
        inst.mark(True)
    return pool


def test_shape_counts_token_ids_and_estimates_text() -> None:
    s = shape_of({"prompt": ids(40), "max_tokens": 7}, "/v1/completions", BS)
    assert (s.prompt_tokens, s.max_tokens, len(s.chain)) == (40, 7, 2)  # 2 full blocks of 16
    assert s.cost("decode") == 47
    assert s.cost("prefill") == 41
    text = shape_of({"prompt": "a" * 200}, "/v1/completions", BS)
    # len // 4 tokens; blocks of 64 characters; vLLM's default max_tokens of 16.
    assert (text.prompt_tokens, text.max_tokens, len(text.chain)) == (50, 16, 3)
    chat = shape_of(
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "b" * 400}]}]},
        "/v1/chat/completions",
        BS,
    )
    assert chat.prompt_tokens == (len("user\n") + 400 + 1) // 4
    assert chat.max_tokens == 1024
    batch = shape_of({"prompt": [ids(20), ids(12)], "max_tokens": 5}, "/v1/completions", BS)
    assert (batch.prompt_tokens, batch.max_tokens, len(batch.chain)) == (32, 10, 1)


def test_chains_share_exactly_their_common_prefix() -> None:
    a = shape_of({"prompt": ids(64)}, "/v1/completions", BS).chain
    b = shape_of({"prompt": ids(40) + ids(24, 1000)}, "/v1/completions", BS).chain
    assert a[:2] == b[:2]
    assert a[2] != b[2] and a[3] != b[3]  # a block's hash covers every block before it
    # Text blocks never match token blocks.
    assert not set(shape_of({"prompt": "x" * 64}, "/v1/completions", BS).chain) & set(a)


def test_prefix_index_is_bounded_and_evicts_least_recent_tails_first() -> None:
    idx = PrefixIndex(capacity=4)
    a = shape_of({"prompt": ids(48)}, "/v1/completions", BS).chain  # 3 blocks
    b = shape_of({"prompt": ids(48, 500)}, "/v1/completions", BS).chain
    idx.add(a)
    assert idx.hit_blocks(a) == 3
    idx.add(b)  # 6 blocks for 4 places: a's last two go, its head stays
    assert len(idx) == 4
    assert idx.hit_blocks(b) == 3
    assert idx.hit_blocks(a) == 1


def test_tokens_policy_weighs_tokens_not_requests() -> None:
    pool = live_pool("decode", Policy.TOKENS)
    big = pool.acquire(shape_of({"prompt": ids(4000)}, "/v1/completions", BS))
    small = shape_of({"prompt": ids(10), "max_tokens": 10}, "/v1/completions", BS)
    two = [pool.acquire(small), pool.acquire(small)]
    assert big.url == "http://d0"
    assert [x.url for x in two] == ["http://d1", "http://d1"]
    # d1 serves two requests but 40 tokens; d0 one of 4016: least_outstanding would say d0.
    assert pool.pick(small).url == "http://d1"
    big.release()
    assert pool.instances[0].tokens == 0
    assert pool.pick(small).url == "http://d0"


def test_cache_aware_prefers_the_cached_instance_until_its_load_outweighs_the_hit() -> None:
    pool = live_pool("prefill", Policy.CACHE_AWARE)
    prompt = shape_of({"prompt": ids(320)}, "/v1/completions", BS)
    first = pool.acquire(prompt)
    first.release()
    assert first.url == "http://p0"
    again = pool.acquire(prompt)
    assert again.url == "http://p0"  # round robin would have said p1
    assert again.pick is not None
    assert (again.pick.hit_tokens, again.pick.tokens_in_flight, again.pick.score) == (320, 0, 320)
    # What is left to compute of it is its load: 1 token (320 + 1 less the 320 held).
    assert again.pick.cost_tokens == pool.instances[0].tokens == 1
    # A longer prompt that starts with it goes there too and adds its 1000 new tokens + 1.
    longer = pool.acquire(shape_of({"prompt": ids(320) + ids(1000, 9000)}, "/v1/completions", BS))
    assert longer.url == "http://p0" and pool.instances[0].tokens == 1002
    # 320 - 1002 < 0: the idle p1 wins.
    other = pool.acquire(prompt)
    assert other.url == "http://p1"
    assert other.pick is not None and other.pick.hit_tokens == 0


def test_cache_aware_alpha_zero_ignores_load() -> None:
    pool = live_pool("prefill", Policy.CACHE_AWARE, alpha=0.0)
    prompt = shape_of({"prompt": ids(64)}, "/v1/completions", BS)
    held = [pool.acquire(prompt) for _ in range(3)]
    assert {x.url for x in held} == {"http://p0"}


@pytest.mark.parametrize(
    ("kw", "says"),
    [
        ({"prefill_policy": "tokens"}, "--prefill-policy 'tokens': expected one of cache_aware"),
        ({"decode_policy": "cache_aware"}, "--decode-policy 'cache_aware': expected one of tok"),
        ({"policy": "tokens"}, "--policy 'tokens': expected one of round_robin"),
        ({"breaker_failures": 0}, "breaker_failures must be at least 1"),
        ({"prefill_alpha": -1}, "prefill_alpha must not be negative"),
    ],
)
def test_policies_per_role(kw: dict[str, object], says: str) -> None:
    base: dict[str, object] = {
        "prefill": ("http://p",),
        "decode": ("http://d",),
        "public_url": "http://r",
    }
    with pytest.raises(ConfigError, match=says):
        ProxyConfig(**(base | kw))  # type: ignore[arg-type]
    cfg = ProxyConfig(**base)  # type: ignore[arg-type]
    assert (cfg.prefill_policy, cfg.decode_policy) == (Policy.CACHE_AWARE, Policy.TOKENS)
    both = ProxyConfig(**(base | {"policy": "least_outstanding"}))  # type: ignore[arg-type]
    assert both.prefill_policy is both.decode_policy is Policy.LEAST_OUTSTANDING


def test_a_repeated_prompt_goes_to_the_prefill_that_served_it(
    make_cluster: Callable[..., Cluster],
) -> None:
    c = make_cluster(n_prefill=2, n_decode=1).start_proxy()
    prompt = ids(100)
    tids = []
    for _ in range(3):
        r = c.post(prompt=prompt, max_tokens=4)
        assert r.status_code == 200
        tids.append(r.headers["x-kv-transfer-id"])
    p0, p1 = c.prefill
    assert (len(p0.requests), len(p1.requests)) == (3, 0)  # p1 stayed idle
    picks = [c.record(t)["prefill_pick"] for t in tids]
    assert [p["hit_tokens"] for p in picks] == [0, 96, 96]  # 6 full blocks of 16
    assert all(p["policy"] == "cache_aware" and p["url"] == p0.url for p in picks)
    assert [p["score"] for p in picks] == [0, 96, 96]
    health = c.get("/health").json()
    assert health["routing"]["prefill"]["last_pick"]["hit_tokens"] == 96
    assert [i["prefix_blocks"] for i in health["prefill"]] == [6, 0]
    # A different prompt has no hit anywhere: the rotation's next, p1.
    assert c.post(prompt=ids(100, 7000), max_tokens=4).status_code == 200
    assert len(p1.requests) == 1


def test_a_loaded_prefill_loses_its_cached_prompt_to_an_idle_one(
    make_cluster: Callable[..., Cluster],
) -> None:
    c = make_cluster(n_prefill=2, n_decode=1).start_proxy(flow="concurrent")
    p0, p1 = c.prefill
    prompt = ids(100)
    assert c.post(prompt=prompt, max_tokens=4).status_code == 200
    gate = threading.Event()
    p0.behaviour.hold = gate  # p0 sits on what comes next: its prefill does not end
    try:
        # A long prompt that starts with the cached one: p0 (its hit), where it stays.
        r = c.post(prompt=prompt + ids(4900, 10_000), max_tokens=1)
        assert r.status_code == 200  # decode answered; p0's prefill is still in flight
        assert len(p0.requests) == 2
        # What is left to compute of it: 5001 less the 96 p0 held.
        assert [i["tokens_in_flight"] for i in c.get("/health").json()["prefill"]] == [4905, 0]
        # p0: 96 cached - 4905 in flight < 0 = p1's score: the idle p1 computes it all.
        r = c.post(prompt=prompt, max_tokens=4)
        assert r.status_code == 200
        pick = c.record(r.headers["x-kv-transfer-id"])["prefill_pick"]
        assert (pick["url"], pick["hit_tokens"], pick["score"]) == (p1.url, 0, 0)
        assert len(p1.requests) == 1
    finally:
        gate.set()
    wait_for(
        "p0's prefill to end", lambda: c.get("/health").json()["prefill"][0]["outstanding"] == 0
    )


def test_decode_goes_to_the_fewest_tokens_in_flight(make_cluster: Callable[..., Cluster]) -> None:
    c = make_cluster(n_prefill=1, n_decode=2).start_proxy()
    d0, d1 = c.decode
    gate = threading.Event()
    d0.behaviour.hold = d1.behaviour.hold = gate
    answers: list[str] = []
    threads: list[threading.Thread] = []

    def send(prompt: list[int], on: int) -> None:
        def post() -> None:
            r = c.post(prompt=prompt, max_tokens=16)
            answers.append(r.headers["x-kv-transfer-id"])

        threads.append(threading.Thread(target=post))
        threads[-1].start()
        wait_for(f"request {on} to reach a decode", lambda: len(d0.requests + d1.requests) == on)

    try:
        send(ids(4000), 1)  # d0: 4016 tokens
        for n in (2, 3, 4):
            send(ids(10, 100 * n), n)  # d1: 26 tokens each
        # least_outstanding would have sent the 4th to d0 (1 request against 2).
        assert (len(d0.requests), len(d1.requests)) == (1, 3)
        health = c.get("/health").json()
        assert [i["tokens_in_flight"] for i in health["decode"]] == [4016, 78]
        assert health["routing"]["decode"]["last_pick"] == {
            "url": d1.url,
            "policy": "tokens",
            "prompt_tokens": 10,
            "cost_tokens": 26,
            "tokens_in_flight": 52,
            "outstanding": 2,
            "hit_tokens": None,
            "score": None,
            "hit_source": None,
            "hit_groups": None,
            "hit_limited_by": None,
            "hit_note": None,
            "pool_hit_tokens": None,
            "hit_tier": None,
            "pool_note": None,
        }
    finally:
        gate.set()
        for t in threads:
            t.join(10)
    assert len(answers) == 4
    assert [i["tokens_in_flight"] for i in c.get("/health").json()["decode"]] == [0, 0]
