"""Chat requests as token ids (chat_tokens.py): what /tokenize is asked, what is refused, the
cache's bounds, and the proxy's fallback to text routing with its reason counted.

The proxy tests' fake engines answer ``/tokenize`` here as the test sets; a real engine's
renderer is checked against these ids in tests/connectors/vllm/test_chat_prompts.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
from fastapi import Request
from fastapi.responses import JSONResponse

from app.proxy import Flow
from app.proxy.chat_tokens import (
    BATCH,
    ENGINE_REFUSED,
    FIELD,
    INVALID,
    NON_TEXT,
    TIMEOUT,
    Fallback,
    IdCache,
    render_key,
    tokenize_body,
)
from app.proxy.routing import shape_of
from tests.proxy.conftest import Cluster, FakeVLLM, sample

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
IDS = list(range(5, 45))  # 40 ids: two whole blocks of the proxy's default 16


def test_documents_and_reasoning_effort_go_where_the_chat_path_puts_them() -> None:
    body = {
        "model": "tiny",
        "messages": MESSAGES,
        "documents": [{"title": "a", "text": "b"}],
        "reasoning_effort": "low",
        "chat_template_kwargs": {"foo": 1, "reasoning_effort": "high"},
        "tools": [{"type": "function", "function": {"name": "f"}}],
        "tool_choice": "auto",
        "add_generation_prompt": True,
        "max_tokens": 9,
        "temperature": 0,
        "stream": True,
    }
    assert tokenize_body(body) == {
        "messages": MESSAGES,
        "model": "tiny",
        "add_generation_prompt": True,
        "tools": body["tools"],
        # The request's own fields win over the client's kwargs, as in build_chat_params.
        "chat_template_kwargs": {
            "foo": 1,
            "documents": body["documents"],
            "reasoning_effort": "low",
            "enable_thinking": True,
        },
    }
    # A client's own enable_thinking stays; reasoning_effort none turns thinking off.
    kept = tokenize_body(
        {"messages": MESSAGES, "reasoning_effort": "none", "chat_template_kwargs": {}}
    )
    assert isinstance(kept, dict)
    assert kept["chat_template_kwargs"] == {"reasoning_effort": "none", "enable_thinking": False}
    own = tokenize_body(
        {
            "messages": MESSAGES,
            "reasoning_effort": "high",
            "chat_template_kwargs": {"enable_thinking": False},
        }
    )
    assert isinstance(own, dict)
    assert own["chat_template_kwargs"]["enable_thinking"] is False


@pytest.mark.parametrize(
    ("extra", "reason", "names"),
    [
        ({"response_format": {"type": "json_object"}}, FIELD, "response_format"),
        (
            {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "none"},
            FIELD,
            "tool_choice",
        ),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f"}}],
                "tool_choice": "required",
            },
            FIELD,
            "tool_choice",
        ),
        ({"truncate_prompt_tokens": 10}, FIELD, "truncate_prompt_tokens"),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "what is this"},
                            {"type": "image_url", "image_url": {"url": "http://x/y.png"}},
                        ],
                    }
                ]
            },
            NON_TEXT,
            "non-text",
        ),
        ({"messages": [MESSAGES, MESSAGES]}, BATCH, "batch"),
        ({"messages": "hi"}, INVALID, "messages"),
        ({"messages": []}, INVALID, "messages"),
        ({"chat_template_kwargs": "x"}, INVALID, "chat_template_kwargs"),
    ],
)
def test_what_tokenize_cannot_render_alike_is_refused_with_its_reason(
    extra: dict[str, Any], reason: str, names: str
) -> None:
    got = tokenize_body({"model": "tiny", "messages": MESSAGES, **extra})
    assert isinstance(got, Fallback), got
    assert got.reason == reason and names in got.detail, got


def test_text_parts_and_tool_choice_without_tools_are_rendered() -> None:
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"text": "b"}]}]
    # tool_choice without tools: vLLM's chat path drops it (build_chat_params).
    got = tokenize_body({"messages": parts, "tool_choice": "required"})
    assert got == {"messages": parts}


def test_the_key_is_the_canonical_render_input_and_names_the_model() -> None:
    a = render_key({"model": "tiny", "messages": MESSAGES})
    assert a == render_key({"messages": MESSAGES, "model": "tiny"})
    assert a != render_key({"model": "tiny-lora", "messages": MESSAGES})
    assert a != render_key({"model": "tiny", "messages": MESSAGES[1:]})


def test_the_cache_is_bounded_in_entries_and_ids_least_recent_first() -> None:
    cache = IdCache(entries=3, tokens=10)
    for k, n in ((b"a", 2), (b"b", 2), (b"c", 2)):
        cache.put(k, tuple(range(n)))
    assert cache.get(b"a") == (0, 1)  # a is now the most recent
    cache.put(b"d", (7,))
    assert (cache.get(b"b"), len(cache)) == (None, 3)  # b was the least recent
    cache.put(b"e", tuple(range(8)))  # 2 + 2 + 1 + 8 ids > 10: c, then a go
    assert [cache.get(k) is not None for k in (b"c", b"a", b"d", b"e")] == [
        False,
        False,
        True,
        True,
    ]
    assert cache.tokens == 9
    cache.put(b"huge", tuple(range(11)))  # more than the whole bound: not kept
    assert cache.get(b"huge") is None and cache.tokens == 9


def test_a_chat_prompt_is_shaped_as_the_same_prompt_sent_as_ids() -> None:
    chat = shape_of({"model": "tiny", "messages": MESSAGES}, "/v1/chat/completions", 16, 4096, IDS)
    ids = shape_of({"model": "tiny", "prompt": IDS}, "/v1/completions", 16, 4096)
    assert (chat.chain, chat.token_ids, chat.prompt_tokens) == (
        ids.chain,
        ids.token_ids,
        ids.prompt_tokens,
    )
    assert len(chat.chain) == 2
    # Without ids: the text chain, as before.
    text = shape_of({"model": "tiny", "messages": MESSAGES}, "/v1/chat/completions", 16)
    assert text.token_ids is None


Tokenize = Callable[[dict[str, Any]], Any]


def serve_tokenize(fake: FakeVLLM, answer: Tokenize, delay_s: float = 0.0) -> list[dict[str, Any]]:
    """Give a fake engine a ``/tokenize`` that answers ``answer(body)``; the bodies it got."""
    got: list[dict[str, Any]] = []

    async def tokenize(request: Request) -> JSONResponse:
        body = await request.json()
        got.append(body)
        await asyncio.sleep(delay_s)
        return JSONResponse(answer(body))

    fake.app.add_api_route("/tokenize", tokenize, methods=["POST"])
    return got


def kv(fake: FakeVLLM) -> dict[str, Any]:
    return dict(fake.requests[-1].body.get("kv_transfer_params") or {})


@pytest.mark.parametrize("flow", list(Flow))
def test_both_engines_get_the_ids_the_request_was_routed_by(
    make_cluster: Callable[..., Cluster], flow: Flow
) -> None:
    c = make_cluster()
    asked = serve_tokenize(c.decode[0], lambda body: {"tokens": IDS, "count": len(IDS)})
    c.start_proxy(flow=flow)
    body: dict[str, Any] = {"messages": MESSAGES, "max_tokens": 3, "reasoning_effort": "low"}
    # The second hits the first's two whole blocks in the prefix index: 8 ids left.
    for hit in (0, 32):
        r = c.post("/v1/chat/completions", **body)
        assert r.status_code == 200, r.text
        record = c.record(r.headers["x-kv-transfer-id"])
        assert kv(c.decode[0])["prompt_token_ids"] == IDS
        assert kv(c.prefill[0])["prompt_token_ids"] == IDS
        # Routed as the ids: tokens in flight count them, not the text's length.
        assert record["decode_pick"]["prompt_tokens"] == len(IDS)
        pick = record["prefill_pick"]
        assert (pick["hit_tokens"], pick["cost_tokens"]) == (hit, len(IDS) - hit + 1), pick
    # The second came from the cache: one /tokenize call, with the request's render inputs.
    assert asked == [
        {
            "messages": MESSAGES,
            "model": "tiny",
            "chat_template_kwargs": {"reasoning_effort": "low", "enable_thinking": True},
        }
    ]
    assert record["chat_tokens"] == "ids from cache"
    m = c.metrics()
    assert sample(m, "kvproxy_chat_prompts_total", source="engine") == 1
    assert sample(m, "kvproxy_chat_prompts_total", source="cache") == 1
    assert sample(m, "kvproxy_chat_tokenize_seconds_count") == 1


def test_decode_alone_gets_the_ids_too(make_cluster: Callable[..., Cluster]) -> None:
    c = make_cluster()
    serve_tokenize(c.decode[0], lambda body: {"tokens": IDS, "count": len(IDS)})
    # 40 ids < 41: decode alone; the text (~10 tokens) would be short too.
    c.start_proxy(min_prefill_tokens=len(IDS) + 1)
    r = c.post("/v1/chat/completions", messages=MESSAGES, max_tokens=2)
    record = c.record(r.headers["x-kv-transfer-id"])
    assert record["reason"] == f"short prompt: {len(IDS)} < {len(IDS) + 1} tokens", record
    assert kv(c.decode[0]) == {"prompt_token_ids": IDS}
    assert not c.prefill[0].requests


@pytest.mark.parametrize(
    ("reason", "setup"),
    [
        (ENGINE_REFUSED, None),  # the fakes have no /tokenize: 404, as a tokenizer-less vLLM
        (TIMEOUT, 0.5),
        ("bad_answer", "bad"),
    ],
)
def test_a_failed_tokenization_routes_as_text_and_counts_why(
    make_cluster: Callable[..., Cluster], reason: str, setup: float | str | None
) -> None:
    c = make_cluster()
    if isinstance(setup, float):
        serve_tokenize(c.decode[0], lambda body: {"tokens": IDS}, delay_s=setup)
    elif setup == "bad":
        serve_tokenize(c.decode[0], lambda body: {"tokens": [1, -2]})
    c.start_proxy(chat_tokens_timeout_s=0.1)
    r = c.post("/v1/chat/completions", messages=MESSAGES, max_tokens=2)
    assert r.status_code == 200, r.text
    record = c.record(r.headers["x-kv-transfer-id"])
    assert record["chat_tokens"].startswith(f"text: {reason}: "), record
    assert "prompt_token_ids" not in kv(c.decode[0])
    assert "prompt_token_ids" not in kv(c.prefill[0])
    # The text estimate (characters / 4), as before chat tokens existed.
    assert record["decode_pick"]["prompt_tokens"] < len(IDS)
    m = c.metrics()
    assert sample(m, "kvproxy_chat_tokens_fallbacks_total", reason=reason) == 1
    assert sample(m, "kvproxy_chat_prompts_total", source="text") == 1


def test_off_asks_no_engine(make_cluster: Callable[..., Cluster]) -> None:
    c = make_cluster()
    asked = serve_tokenize(c.decode[0], lambda body: {"tokens": IDS})
    c.start_proxy(chat_tokens=False)
    r = c.post("/v1/chat/completions", messages=MESSAGES, max_tokens=2)
    record = c.record(r.headers["x-kv-transfer-id"])
    assert (asked, record["chat_tokens"]) == ([], None)
    assert "prompt_token_ids" not in kv(c.decode[0])
