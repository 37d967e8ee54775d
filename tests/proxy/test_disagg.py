"""Conditional disaggregation: short prompts, and prompts the picked decode already holds, go
to decode alone as plain requests; prefill is not asked."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import typer

from app.cli.main import app as cli_app
from app.errors import ConfigError
from app.proxy import ProxyConfig
from app.proxy.disagg import DisaggRules
from app.proxy.routing import Pick, shape_of
from tests.proxy.conftest import Cluster

RULES_ON = {"min_prefill_tokens": 256, "decode_hit_fraction": 0.8}


def ids(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def served(c: Cluster, **body: Any) -> dict[str, Any]:
    """Post ``body``; the proxy's settled record of it."""
    r = c.post(**body)
    assert r.status_code == 200
    return c.record(r.headers["x-kv-transfer-id"])


def counts(c: Cluster) -> tuple[int, int, int]:
    d = c.get("/health").json()["disaggregation"]
    local = d["local_short"] + d["local_cached"] + d["local_embeds"] + d["local_no_prefill"]
    assert d["local"] == local
    return d["local_short"], d["local_cached"], d["disaggregated"]


def test_decide_reads_the_prompt_size_and_the_decode_hit() -> None:
    rules = DisaggRules(min_prefill_tokens=256, decode_hit_fraction=0.8)
    shape = shape_of({"prompt": ids(300)}, "/v1/completions", 16)
    pick = Pick("http://d", "tokens", 300, 316, 0, 0, hit_tokens=240)
    # 240 / 300 = 0.8 exactly: enough.
    assert rules.decide(shape, pick).reason == "decode holds ~240 of 300 tokens"
    assert not rules.decide(shape, pick).disaggregated
    less = rules.decide(shape, Pick("http://d", "tokens", 300, 316, 0, 0, hit_tokens=224))
    assert (less.disaggregated, less.kind) == (True, "disaggregated")
    assert less.reason == "decode holds ~224 of 300 tokens (< 0.8)"
    short = rules.decide(shape_of({"prompt": ids(40)}, "/v1/completions", 16), pick)
    assert (short.disaggregated, short.kind) == (False, "short")
    assert short.reason == "short prompt: 40 < 256 tokens"


def test_prompt_embeddings_go_to_decode_alone(make_cluster: Callable[..., Cluster]) -> None:
    """No KV moves for embeddings (the connectors skip them): a prefill would compute the
    prompt for nothing, so decode computes it alone, however long."""
    rules = DisaggRules(min_prefill_tokens=0, decode_hit_fraction=2)
    embeds = rules.decide(shape_of({"prompt_embeds": "AAAA"}, "/v1/completions", 16), None)
    assert (embeds.disaggregated, embeds.kind) == (False, "embeds")
    c = make_cluster().start_proxy(flow="concurrent", min_prefill_tokens=0)
    (d,), (p,) = c.decode, c.prefill
    r = c.post(prompt_embeds="AAAA", max_tokens=4)
    assert r.status_code == 200 and r.content == d.answers[-1]
    assert p.requests == []
    assert c.get("/health").json()["disaggregation"]["local_embeds"] == 1


def test_a_short_prompt_goes_to_decode_alone(make_cluster: Callable[..., Cluster]) -> None:
    c = make_cluster().start_proxy(flow="concurrent", **RULES_ON)
    (d,), (p,) = c.decode, c.prefill
    # A client's kv_transfer_params never reach an engine.
    r = c.post(prompt=ids(40), max_tokens=4, kv_transfer_params={"do_remote_prefill": True})
    assert r.status_code == 200 and r.content == d.answers[-1]
    rec = c.record(r.headers["x-kv-transfer-id"])
    [seen] = d.requests
    assert "kv_transfer_params" not in seen.body and seen.body["prompt"] == ids(40)
    assert d.posts == []  # no target posted: decode computes the prompt itself
    assert (rec["status"], rec["disaggregated"], rec["reason"]) == (
        "local",
        False,
        "short prompt: 40 < 256 tokens",
    )
    assert rec["prefill"] is None and rec["prefill_pick"] is None
    # Streamed the same way.
    r = c.post(prompt="a short question", stream=True)
    assert r.status_code == 200 and r.content == d.answers[-1]
    assert c.record(r.headers["x-kv-transfer-id"])["status"] == "local"
    assert p.requests == []
    assert counts(c) == (2, 0, 0)
    assert c.get("/health").json()["prefill"][0]["served"] == 0


def test_a_long_prompt_is_disaggregated(make_cluster: Callable[..., Cluster]) -> None:
    c = make_cluster().start_proxy(flow="concurrent", **RULES_ON)
    (d,), (p,) = c.decode, c.prefill
    rec = served(c, prompt=ids(300), max_tokens=4)
    [seen] = d.requests
    assert seen.body["kv_transfer_params"]["do_remote_prefill"] is True
    assert len(p.requests) == 1
    assert (rec["status"], rec["disaggregated"], rec["prefill"]) == ("ok", True, p.url)
    assert rec["reason"] == "decode holds ~0 of 300 tokens (< 0.8)"
    assert counts(c) == (0, 0, 1)


def test_a_repeated_long_prompt_is_served_by_the_decode_that_holds_it(
    make_cluster: Callable[..., Cluster],
) -> None:
    c = make_cluster().start_proxy(**RULES_ON)
    (d,), (p,) = c.decode, c.prefill
    prompt = ids(300)
    first = served(c, prompt=prompt, max_tokens=4)
    assert first["disaggregated"] is True and first["decode_pick"]["hit_tokens"] == 0
    again = served(c, prompt=prompt, max_tokens=4)
    # 18 full blocks of 16 = 288 of 300 tokens: 0.96 >= 0.8.
    assert (again["status"], again["disaggregated"]) == ("local", False)
    assert again["reason"] == "decode holds ~288 of 300 tokens"
    assert again["decode_pick"]["hit_tokens"] == 288
    assert "kv_transfer_params" not in d.requests[-1].body
    assert len(p.requests) == 1  # the first time only
    # A prompt sharing 192 of its 300 tokens (0.64): through prefill again.
    partial = served(c, prompt=prompt[:200] + ids(100, 9000), max_tokens=4)
    assert partial["disaggregated"] is True
    assert partial["reason"] == "decode holds ~192 of 300 tokens (< 0.8)"
    assert len(p.requests) == 2
    assert counts(c) == (0, 1, 2)


def test_each_rule_can_be_turned_off(make_cluster: Callable[..., Cluster]) -> None:
    c = make_cluster().start_proxy(min_prefill_tokens=0, decode_hit_fraction=1.01)
    (p,) = c.prefill
    short = served(c, prompt=ids(40), max_tokens=4)
    assert (short["disaggregated"], short["reason"]) == (True, "prompt of 40 tokens")
    for _ in range(2):
        assert served(c, prompt=ids(300), max_tokens=4)["disaggregated"] is True
    assert len(p.requests) == 3
    assert counts(c) == (0, 0, 3)
    # The hit rule off, decode keeps no prefix index.
    assert c.get("/health").json()["decode"][0]["prefix_blocks"] is None


def test_decode_alone_needs_no_healthy_prefill(make_cluster: Callable[..., Cluster]) -> None:
    c = make_cluster()
    c.prefill[0].behaviour.health_status = 503
    c.start_proxy(without_prefill="refuse", **RULES_ON)
    assert served(c, prompt=ids(40), max_tokens=4)["status"] == "local"
    r = c.post(prompt=ids(300), max_tokens=4)
    assert r.status_code == 503 and "no healthy prefill instance" in r.json()["error"]["message"]
    assert counts(c) == (1, 0, 0)  # a refused request is not counted


def test_a_failed_local_request_is_recorded_as_such(make_cluster: Callable[..., Cluster]) -> None:
    c = make_cluster().start_proxy(**RULES_ON)
    c.decode[0].behaviour.status = 500
    r = c.post(prompt=ids(40), max_tokens=4)
    assert r.status_code == 500
    rec = c.record(r.headers["x-kv-transfer-id"])
    assert (rec["status"], rec["disaggregated"]) == ("decode_failed", False)


@pytest.mark.parametrize(
    ("kw", "says"),
    [
        ({"min_prefill_tokens": -1}, "min_prefill_tokens must not be negative"),
        ({"decode_hit_fraction": 0}, "decode_hit_fraction must be positive"),
    ],
)
def test_bad_thresholds_are_refused(kw: dict[str, object], says: str) -> None:
    base: dict[str, object] = {
        "prefill": ("http://p",),
        "decode": ("http://d",),
        "public_url": "http://r",
    }
    with pytest.raises(ConfigError, match=says):
        ProxyConfig(**(base | kw))  # type: ignore[arg-type]
    cfg = ProxyConfig(**base)  # type: ignore[arg-type]
    assert (cfg.min_prefill_tokens, cfg.decode_hit_fraction) == (256, 0.8)


def test_the_cli_takes_both_thresholds() -> None:
    proxy = typer.main.get_command(cli_app).commands["proxy"]  # type: ignore[attr-defined]
    args = ["--prefill", "http://p", "--decode", "http://d"]
    params = proxy.make_context("proxy", [*args, "--min-prefill-tokens", "0"]).params
    assert (params["min_prefill_tokens"], params["decode_hit_fraction"]) == (0, 0.8)
    params = proxy.make_context("proxy", [*args, "--decode-hit-fraction", "2"]).params
    assert (params["min_prefill_tokens"], params["decode_hit_fraction"]) == (256, 2.0)
