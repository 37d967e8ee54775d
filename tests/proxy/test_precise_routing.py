"""Precise routing: the proxy reads each prefill's own KV events (vLLM's cache manager and
publisher, over real ZMQ) and routes by what the engine holds, at the hit vLLM's coordinator
accepts; the prefix index stands in, and says so, where the events cannot answer."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from app.proxy.kv_events import EngineEvents
from tests.proxy.conftest import Cluster, sample, wait_for
from tests.proxy.kv_events.engine import (
    CacheEngine,
    Endpoints,
    full_attention,
    prompt,
    publisher,
    sliding_window,
)


@pytest.fixture
def engines() -> Iterator[Callable[..., tuple[CacheEngine, Endpoints]]]:
    """``engines(**CacheEngine kwargs)``: a cache manager publishing on fresh loopback ports."""
    made: list[CacheEngine] = []

    def make(**kw: Any) -> tuple[CacheEngine, Endpoints]:
        ends = Endpoints.new()
        e = CacheEngine(pub=publisher(ends, topic=""), **kw)
        made.append(e)
        return e, ends

    yield make
    for e in made:
        e.close()


def start(
    c: Cluster, ends: list[Endpoints], decode_ends: tuple[Endpoints, ...] = (), **cfg: Any
) -> Cluster:
    """The proxy over ``c``, following the events of its prefills (``ends``, in order) and
    decodes (``decode_ends``); returns once every index is consistent and its SUB socket had
    time to join."""
    pairs = [*zip(c.prefill, ends, strict=False), *zip(c.decode, decode_ends, strict=False)]
    sources = tuple(EngineEvents(f.url, e.sub, e.replay) for f, e in pairs)
    c.start_proxy(kv_events=sources, **cfg)
    wait_for("every KV event index to be consistent", lambda: all(consistent(c)))
    time.sleep(0.3)  # ZMQ drops what is published before the subscription reached it
    return c


def consistent(c: Cluster) -> list[bool]:
    return [s["index"]["consistent"] for s in c.get("/health").json()["kv_events"]]


def applied(c: Cluster) -> list[int | None]:
    """Per followed engine, the seq of the last event batch its index applied."""
    return [s["index"]["last_seq"] for s in c.get("/health").json()["kv_events"]]


def until_applied(c: Cluster, what: str, seqs: list[int | None]) -> None:
    """Until the indexes applied ``seqs``. A batch published before a SUB socket joined is
    lost there; the subscriber's idle check (5 s) replays it, so allow for one."""
    wait_for(what, lambda: applied(c) == seqs, timeout_s=15.0)


def vllm_hit(engine: CacheEngine, tokens: list[int]) -> int:
    """The computed tokens vLLM's own scheduler would skip for this prompt there."""
    _, hit, _ = engine.manager.get_computed_blocks(engine.request(tokens))
    return int(hit)


def prefill_pick(c: Cluster, tokens: list[int]) -> dict[str, Any]:
    r = c.post(prompt=tokens, max_tokens=4)
    assert r.status_code == 200, r.text
    pick = c.record(r.headers["x-kv-transfer-id"])["prefill_pick"]
    assert isinstance(pick, dict)
    return pick


def test_the_prompt_goes_where_the_engine_holds_it_not_where_it_was_sent(
    make_cluster: Callable[..., Cluster],
    engines: Callable[..., tuple[CacheEngine, Endpoints]],
) -> None:
    (_, ends0), (e1, ends1) = engines(num_blocks=24), engines(num_blocks=24)
    c = start(make_cluster(n_prefill=2, n_decode=1), [ends0, ends1])
    p0, p1 = c.prefill
    x = prompt(160, 1)
    # Nobody holds x: a tie, the rotation's first. The guess now says p0 holds it.
    first = prefill_pick(c, x)
    assert (first["url"], first["hit_tokens"], first["hit_source"]) == (p0.url, 0, "kv_events")
    # p0's engine never kept it (the fakes compute nothing); p1's got it by another path (a
    # pool load, a transfer into it): only its events say so.
    e1.serve(x)
    e1.publish()
    until_applied(c, "p1's stores to reach the proxy", [None, 0])
    again = prefill_pick(c, x)
    # 160 tokens: the last is always recomputed, so 9 whole blocks are what vLLM reuses.
    assert (again["url"], again["hit_tokens"]) == (p1.url, vllm_hit(e1, x)) == (p1.url, 144)
    assert again["hit_source"] == "kv_events" and again["hit_groups"] == {"0/GPU": 144}
    assert again["score"] == 144 and again["hit_note"] is None
    assert (len(p0.requests), len(p1.requests)) == (1, 1)
    # p1's engine evicts x's tail for other prompts: the events take that much away again.
    for i in range(2):
        e1.serve(prompt(160, 10 + i))
    e1.publish()
    until_applied(c, "the evictions", [None, 1])
    left = vllm_hit(e1, x)
    assert 0 < left < 144
    later = prefill_pick(c, x)
    assert (later["url"], later["hit_tokens"]) == (p1.url, left)
    e1.reset()
    e1.publish()
    until_applied(c, "the reset", [None, 2])
    # Nobody holds x now; the tie rotates to p0.
    gone = prefill_pick(c, x)
    assert (gone["url"], gone["hit_tokens"], gone["hit_source"]) == (p0.url, 0, "kv_events")
    # A text prompt cannot be keyed without a tokenizer: the guess answers, and says why.
    r = c.post(prompt="some words " * 40, max_tokens=4)
    text = c.record(r.headers["x-kv-transfer-id"])["prefill_pick"]
    assert text["hit_source"] == "approximate" and "text prompt" in text["hit_note"]
    # /metrics: the picks by where their hit came from, and each index's state.
    m = c.metrics()
    assert sample(m, "kvproxy_picks_total", role="prefill", source="kv_events") == 4
    assert sample(m, "kvproxy_picks_total", role="prefill", source="approximate") == 1
    for p in (p0, p1):
        assert sample(m, "kvproxy_kv_events_consistent", instance=p.url) == 1
        assert sample(m, "kvproxy_kv_events_blocks", instance=p.url) == 0  # p1 was reset


def test_a_window_group_scores_at_the_coordinators_hit_not_the_full_prefix(
    make_cluster: Callable[..., Cluster],
    engines: Callable[..., tuple[CacheEngine, Endpoints]],
) -> None:
    hybrid = {"num_blocks": 24, "groups": [full_attention(16), sliding_window(32, 16)]}
    (e0, ends0), (e1, ends1) = engines(**hybrid), engines(**hybrid)
    c = start(make_cluster(n_prefill=2, n_decode=1), [ends0, ends1])
    p1 = c.prefill[1]
    a = prompt(160, 1)
    # p0 holds all of a in full attention, but its window group lost blocks 1..3.
    e0.serve_with_window_gap(a, 96)
    e0.serve(prompt(48, 2))
    e0.publish()
    # p1 holds a's first 3 blocks in both groups.
    e1.serve(a[:48] + prompt(8, 3))
    e1.publish()
    until_applied(c, "both engines' stores", [0, 0])
    q = a[:80] + prompt(40, 4)  # 5 blocks of a, then its own
    assert (e0.held(q), e0.held(q, group=1), e1.held(q)) == (5, 1, 3)
    assert (vllm_hit(e0, q), vllm_hit(e1, q)) == (16, 48)
    pick = prefill_pick(c, q)
    # By full attention alone p0 (80 tokens) beats p1 (48); the coordinator gives p0 16.
    assert (pick["url"], pick["hit_tokens"]) == (p1.url, 48)
    assert pick["hit_groups"] == {"0/GPU": 48, "1/GPU": 48}
    assert pick["hit_limited_by"] == "0/GPU"  # p1 holds no more of a than 3 blocks


def test_without_consistent_events_the_guess_answers_and_says_why(
    make_cluster: Callable[..., Cluster],
) -> None:
    # An endpoint nobody publishes on: the index never learns the engine's state.
    dead = Endpoints.new()
    c = make_cluster(n_prefill=2, n_decode=1)
    c.start_proxy(kv_events=(EngineEvents(c.prefill[0].url, dead.sub, dead.replay),))
    feeds = c.get("/health").json()["kv_events"]
    assert [f["name"] for f in feeds] == [c.prefill[0].url]
    assert feeds[0]["index"]["consistent"] is False and feeds[0]["index"]["reason"]
    assert sample(c.metrics(), "kvproxy_kv_events_consistent", instance=c.prefill[0].url) == 0
    x = prompt(100, 1)
    first = prefill_pick(c, x)
    assert first["hit_source"] == "approximate"
    assert "KV event index inconsistent" in first["hit_note"]
    again = prefill_pick(c, x)  # the guess: p0 was sent x
    assert (again["url"], again["hit_tokens"], again["hit_source"]) == (
        c.prefill[0].url,
        96,
        "approximate",
    )


def test_decode_holding_the_prompt_serves_it_alone_by_its_events(
    make_cluster: Callable[..., Cluster],
    engines: Callable[..., tuple[CacheEngine, Endpoints]],
) -> None:
    (_, ends0), (d1_engine, ends1) = engines(num_blocks=24), engines(num_blocks=24)
    c = make_cluster(n_prefill=1, n_decode=2)
    # The disaggregation rules on: a prompt decode holds 80% of stays there.
    start(c, [], (ends0, ends1), min_prefill_tokens=0, decode_hit_fraction=0.8)
    x = prompt(161, 1)
    d1_engine.serve(x)  # e.g. an earlier transfer into d1
    d1_engine.publish()
    until_applied(c, "d1's stores", [None, 0])
    r = c.post(prompt=x, max_tokens=4)
    assert r.status_code == 200
    record = c.record(r.headers["x-kv-transfer-id"])
    pick = record["decode_pick"]
    # tokens in flight less what it holds: d1 (0 - 160) beats d0 (0 - 0).
    assert (pick["url"], pick["hit_tokens"], pick["hit_source"]) == (
        c.decode[1].url,
        vllm_hit(d1_engine, x),
        "kv_events",
    )
    assert pick["hit_tokens"] == 160
    assert record["disaggregated"] is False and "decode holds ~160 of 161" in record["reason"]
    assert len(c.prefill[0].requests) == 0


def test_a_prompt_in_flight_counts_before_its_events_come(
    make_cluster: Callable[..., Cluster],
    engines: Callable[..., tuple[CacheEngine, Endpoints]],
) -> None:
    (_, ends0), (_, ends1) = engines(num_blocks=24), engines(num_blocks=24)
    c = start(make_cluster(n_prefill=2, n_decode=1), [ends0, ends1], flow="concurrent")
    p0, p1 = c.prefill
    gate = threading.Event()
    p0.behaviour.hold = p1.behaviour.hold = gate
    x = prompt(160, 1)
    tids: dict[int, str] = {}  # by prompt length

    def post(tokens: list[int]) -> None:
        r = c.post(prompt=tokens, max_tokens=4)
        tids[len(tokens)] = r.headers["x-kv-transfer-id"]

    def send(tokens: list[int], on: int) -> None:
        threads.append(threading.Thread(target=post, args=(tokens,)))
        threads[-1].start()
        wait_for(f"request {on} to reach a prefill", lambda: len(p0.requests + p1.requests) == on)

    threads: list[threading.Thread] = []
    try:
        send(x, 1)  # p0 (a tie: the rotation's first): 161 tokens in flight there
        send(prompt(100, 2), 2)  # p1, the less loaded: 101 tokens in flight
        # x's blocks are not stored yet (p0 still computes it): only the request in flight
        # says p0 will hold them. By load alone p1 (101 in flight) beats p0 (161); with x's
        # 160 tokens p0 would hold, p0 (160 - 161) beats p1 (0 - 101).
        send(x + prompt(40, 3), 3)
        assert (len(p0.requests), len(p1.requests)) == (2, 1)
    finally:
        gate.set()
        for t in threads:
            t.join()
    third = c.record(tids[200])["prefill_pick"]
    assert (third["url"], third["hit_source"], third["hit_tokens"]) == (p0.url, "in_flight", 160)
    assert "in flight" in third["hit_note"]
    # Both ended: nothing is in flight any more, and no event said p0 stored x.
    after = prefill_pick(c, x)
    assert (after["hit_source"], after["hit_tokens"]) == ("kv_events", 0)


def test_a_prompt_identical_to_one_in_flight_scores_at_most_prompt_less_one(
    make_cluster: Callable[..., Cluster],
    engines: Callable[..., tuple[CacheEngine, Endpoints]],
) -> None:
    """The request in flight will store all 10 blocks of a 160-token prompt, but vLLM always
    computes a prompt's last token: the same prompt can reuse at most 159 tokens, so 9 whole
    blocks, 144 (what vLLM's scheduler skips once the blocks are stored, checked last)."""
    e0, ends0 = engines(num_blocks=24)
    c = start(make_cluster(n_prefill=1, n_decode=1), [ends0], flow="concurrent")
    (p0,) = c.prefill
    gate = threading.Event()
    p0.behaviour.hold = gate
    x = prompt(160, 1)
    tids: list[str] = []

    def post() -> None:
        r = c.post(prompt=x, max_tokens=4)
        tids.append(r.headers["x-kv-transfer-id"])

    threads = [threading.Thread(target=post) for _ in range(2)]
    try:
        for n, t in enumerate(threads, 1):
            t.start()
            wait_for(f"request {n} to reach the prefill", lambda n=n: len(p0.requests) == n)
    finally:
        gate.set()
        for t in threads:
            t.join()
    picks = [c.record(tid)["prefill_pick"] for tid in tids]
    second = next(p for p in picks if p["hit_source"] == "in_flight")
    assert second["hit_tokens"] <= len(x) - 1
    assert second["hit_tokens"] == 144
    e0.serve(x)
    assert vllm_hit(e0, x) == 144
