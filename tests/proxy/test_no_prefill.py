"""A request that needs a prefill when no prefill instance is available (all unhealthy, or
their breakers open) is served by decode alone, as a short one is: the record says why, and
``kvproxy_prefill_unavailable_total`` counts it. ``--without-prefill refuse`` answers 503
instead (the old behaviour), counted too."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from app.errors import ConfigError
from app.proxy import ProxyConfig
from tests.proxy.conftest import Cluster, sample
from tests.proxy.test_pool_tier import FakePool

PROMPT = list(range(300))  # long enough to need a prefill with the default 256 threshold
RULES_ON = {"min_prefill_tokens": 256, "decode_hit_fraction": 0.8}


@pytest.fixture
def fake_pool() -> Iterator[FakePool]:
    fake = FakePool()
    yield fake
    fake.server.stop()


def unavailable(c: Cluster, action: str) -> float | None:
    return sample(c.metrics(), "kvproxy_prefill_unavailable_total", action=action)


def requests(c: Cluster, reason: str, outcome: str) -> float | None:
    labels = {"route": "/v1/completions", "decision": "local", "reason": reason}
    return sample(c.metrics(), "kvproxy_requests_total", **labels, outcome=outcome)


def served_alone(c: Cluster, prompt: list[int] = PROMPT) -> dict[str, Any]:
    r = c.post(prompt=prompt, max_tokens=4)
    assert r.status_code == 200, r.text
    assert r.content == c.decode[0].answers[-1]  # decode's own answer, relayed
    return c.record(r.headers["x-kv-transfer-id"])


def test_every_prefill_unhealthy_serves_a_long_prompt_by_decode_alone(
    make_cluster: Callable[..., Cluster],
) -> None:
    c = make_cluster(n_prefill=2)
    for p in c.prefill:
        p.behaviour.health_status = 503
    c.start_proxy(flow="concurrent", **RULES_ON)
    rec = served_alone(c)
    tried = ", ".join(p.url for p in c.prefill)
    assert (rec["status"], rec["disaggregated"], rec["prefill"]) == ("local", False, None)
    assert rec["reason"] == (
        f"no healthy prefill instance (tried: {tried}): decode computes the prompt alone "
        "(decode holds ~0 of 300 tokens (< 0.8))"
    )
    assert rec["prefill_pick"] is None
    # A plain request: no transfer for decode to wait on.
    assert "kv_transfer_params" not in c.decode[0].requests[-1].body
    assert not any(p.requests for p in c.prefill)
    assert unavailable(c, "decode_alone") == 1 and unavailable(c, "refused") is None
    assert requests(c, "no_prefill", "ok") == 1
    d = c.get("/health").json()["disaggregation"]
    assert (d["local_no_prefill"], d["local"], d["disaggregated"]) == (1, 1, 0)


def test_an_open_breaker_counts_as_unavailable(make_cluster: Callable[..., Cluster]) -> None:
    """/health answers, completions fail: the breaker takes the prefill out, decode serves."""
    c = make_cluster()
    c.prefill[0].behaviour.status = 500
    c.start_proxy(breaker_failures=1, breaker_probe_interval_s=30.0, **RULES_ON)
    first = c.post(prompt=PROMPT, max_tokens=4)
    assert first.status_code == 200
    assert c.record(first.headers["x-kv-transfer-id"])["status"] == "prefill_failed"
    rec = served_alone(c, [t + 1000 for t in PROMPT])  # one decode does not hold yet
    assert rec["reason"].startswith("no healthy prefill instance")
    assert "circuit open" in rec["reason"]
    assert len(c.prefill[0].requests) == 1  # the failed one only
    assert unavailable(c, "decode_alone") == 1


def test_refuse_keeps_the_503(make_cluster: Callable[..., Cluster]) -> None:
    c = make_cluster()
    c.prefill[0].behaviour.health_status = 503
    c.start_proxy(without_prefill="refuse", **RULES_ON)
    r = c.post(prompt=PROMPT, max_tokens=4)
    assert r.status_code == 503
    assert r.json()["error"]["message"] == (
        f"no healthy prefill instance (tried: {c.prefill[0].url})"
    )
    assert not c.decode[0].requests
    assert unavailable(c, "refused") == 1 and unavailable(c, "decode_alone") is None


def test_the_pool_is_not_asked_for_a_pick_that_cannot_happen(
    make_cluster: Callable[..., Cluster], fake_pool: FakePool
) -> None:
    """A lookup takes up to 0.25 s: with no prefill to weigh, it would only delay decode."""
    c = make_cluster()
    c.prefill[0].behaviour.health_status = 503
    c.start_proxy(pool_lookup=fake_pool.server.url, **RULES_ON)
    assert served_alone(c)["status"] == "local"
    assert fake_pool.asked == []


def test_the_setting_takes_only_its_two_choices() -> None:
    urls: dict[str, Any] = {"prefill": ("http://p",), "decode": ("http://d",)}
    with pytest.raises(ConfigError, match=r"--without-prefill 'drop': expected one of "):
        ProxyConfig(**urls, public_url="http://x", without_prefill="drop")  # type: ignore[arg-type]
    assert ProxyConfig(**urls, public_url="http://x").without_prefill == "decode_alone"
