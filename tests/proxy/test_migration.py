"""Mid-stream migration's pure parts (app/proxy/migration.py): what can be resumed, the
remaining max_tokens, and the stitching of two decodes' events into one client stream."""

from __future__ import annotations

import json
from typing import Any

import pytest

from app.proxy.migration import Stitch, refusal, remaining_max_tokens, split_events


def _sse(*events: dict[str, Any] | str) -> bytes:
    out = b""
    for e in events:
        out += b"data: " + (e.encode() if isinstance(e, str) else json.dumps(e).encode()) + b"\n\n"
    return out


def _parsed(out: list[bytes]) -> list[Any]:
    """Each relayed event's JSON object, or ``[DONE]``."""
    got: list[Any] = []
    for raw in out:
        text = raw.decode().strip().removeprefix("data: ")
        got.append(text if text == "[DONE]" else json.loads(text))
    return got


@pytest.mark.parametrize(
    ("body", "path", "why"),
    [
        ({"prompt": [1, 2], "temperature": 0}, "/v1/completions", None),
        ({"prompt": "x", "temperature": 0.8}, "/v1/completions", None),  # unseeded sampling
        ({"prompt": "x", "temperature": 0, "seed": 3}, "/v1/completions", None),  # greedy
        ({"messages": [], "tools": [{}], "tool_choice": "none"}, "/v1/chat/completions", None),
        ({"prompt": "x", "seed": 3}, "/v1/completions", "seeded sampling"),
        ({"prompt": "x", "temperature": 0.7, "seed": 3}, "/v1/completions", "seeded sampling"),
        ({"prompt": "x", "presence_penalty": 0.5}, "/v1/completions", "presence_penalty"),
        ({"prompt": "x", "frequency_penalty": 0.1}, "/v1/completions", "frequency_penalty"),
        ({"prompt": "x", "repetition_penalty": 1.1}, "/v1/completions", None),
        ({"prompt": "x", "bad_words": ["a b"]}, "/v1/completions", "bad_words"),
        ({"prompt": "x", "stop": ["\n"]}, "/v1/completions", "stop strings"),
        ({"prompt": "x", "logprobs": 2}, "/v1/completions", "logprobs"),
        ({"prompt": "x", "n": 2}, "/v1/completions", "several choices"),
        ({"prompt": ["a", "b"]}, "/v1/completions", "several prompts"),
        ({"messages": [], "tools": [{}]}, "/v1/chat/completions", "tools"),
        (
            {"messages": [], "response_format": {"type": "json_object"}},
            "/v1/chat/completions",
            "response_format",
        ),
        ({"prompt": "x", "structured_outputs": {"regex": "a+"}}, "/v1/completions", "grammar"),
    ],
)
def test_what_can_be_resumed(body: dict[str, Any], path: str, why: str | None) -> None:
    got = refusal(body, path)
    assert (got is None) if why is None else (got is not None and why in got), got


def test_remaining_max_tokens() -> None:
    assert remaining_max_tokens({"max_tokens": 10}, chat=False, generated=3) == 7
    assert remaining_max_tokens({}, chat=False, generated=3) == 13  # vLLM's default 16
    assert remaining_max_tokens({"max_completion_tokens": 9}, chat=True, generated=4) == 5
    assert remaining_max_tokens({"max_tokens": 9}, chat=True, generated=4) == 5
    assert remaining_max_tokens({}, chat=True, generated=4) is None  # the context left


def test_events_are_split_only_when_whole() -> None:
    events, rest = split_events(b'data: {"a": 1}\n\ndata: [DONE]\n\ndata: {"b"')
    assert [e.data for e in events] == [{"a": 1}, None] and events[1].done
    assert rest == b'data: {"b"'


def _completion(ids: list[int], finish: str | None = None, **extra: Any) -> dict[str, Any]:
    choice = {"index": 0, "text": "".join(f" w{i}" for i in ids), "token_ids": ids}
    return {
        "id": extra.pop("id", "cmpl-a"),
        "created": 1,
        "model": "m",
        "choices": [{**choice, "finish_reason": finish, **extra}],
    }


def test_a_completions_stream_is_stitched_without_a_repeated_or_missing_token() -> None:
    body = {"prompt": "text", "max_tokens": 6, "stream_options": {"include_usage": True}}
    s = Stitch(body, "/v1/completions")
    # Decode sends two events, and half of a third when it dies: that one is not relayed.
    first = _sse(_completion([10], prompt_token_ids=[1, 2, 3]), _completion([11, 12]))
    out = s.feed(first + b'data: {"id": "cmpl-a", "choices": [{"token_ids": [13]')
    assert [c["choices"][0]["token_ids"] for c in _parsed(out)] == [None, None]  # not asked
    assert [c["choices"][0].get("prompt_token_ids") for c in _parsed(out)] == [None, None]
    assert s.why_not() is None
    cont = s.continuation()
    assert cont["prompt"] == [1, 2, 3, 10, 11, 12] and cont["max_tokens"] == 3
    assert cont["stream"] and cont["return_token_ids"] and "echo" not in cont
    usage = {"prompt_tokens": 6, "completion_tokens": 3, "total_tokens": 9}
    second = _sse(
        _completion([13], prompt_token_ids=[1, 2, 3, 10, 11, 12], id="cmpl-b"),
        _completion([14, 15], "length", id="cmpl-b"),
        {"id": "cmpl-b", "created": 2, "model": "m", "choices": [], "usage": usage},
        "[DONE]",
    )
    events = _parsed(s.feed(second))
    assert s.generated == [10, 11, 12, 13, 14, 15] and s.done
    assert all(e["id"] == "cmpl-a" and e["created"] == 1 for e in events[:-1])
    assert events[-2]["usage"] == {"prompt_tokens": 3, "completion_tokens": 6, "total_tokens": 9}
    assert events[1]["choices"][0]["finish_reason"] == "length"


def test_a_chat_stream_goes_on_as_chat_chunks_from_a_completions_continuation() -> None:
    body = {"messages": [], "max_completion_tokens": 5, "return_token_ids": True}
    s = Stitch(body, "/v1/chat/completions")
    role = {
        "id": "chat-a",
        "created": 1,
        "model": "m",
        "object": "chat.completion.chunk",
        "prompt_token_ids": [7, 8],
        "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}],
    }
    tok = {
        "id": "chat-a",
        "created": 1,
        "model": "m",
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": {"content": " w9"}, "token_ids": [9]}],
    }
    shown = _parsed(s.feed(_sse(role, tok)))
    assert shown[0]["prompt_token_ids"] == [7, 8]  # asked: kept
    cont = s.continuation()
    assert cont["prompt"] == [7, 8, 9] and cont["max_tokens"] == 4 and "messages" not in cont
    resumed = _parsed(s.feed(_sse(_completion([10], "stop", prompt_token_ids=[7, 8, 9]), "[DONE]")))
    assert resumed[0] == {
        "id": "chat-a",
        "created": 1,
        "model": "m",
        "object": "chat.completion.chunk",
        "choices": [
            {
                "index": 0,
                "delta": {"content": " w10"},
                "logprobs": None,
                "finish_reason": "stop",
                "token_ids": [10],
            }
        ],
    }


@pytest.mark.parametrize(
    ("delta", "why"),
    [
        ({"tool_calls": [{"index": 0}]}, "tool call"),
        ({"reasoning": "hm"}, "reasoning"),
        ({"content": "x"}, "no token ids"),  # an engine that ignores return_token_ids
    ],
)
def test_what_was_streamed_can_make_it_unresumable(delta: dict[str, Any], why: str) -> None:
    s = Stitch({"messages": []}, "/v1/chat/completions", prompt_hint=[1])
    ids = {} if why == "no token ids" else {"token_ids": [4]}
    s.feed(_sse({"id": "c", "choices": [{"index": 0, "delta": delta, **ids}]}))
    assert why in (s.why_not() or "")


def test_an_error_event_is_a_failure_unless_it_is_the_requests_own() -> None:
    s = Stitch({"prompt": [1]}, "/v1/completions")
    own = {"error": {"message": "bad", "code": 400}}
    assert _parsed(s.feed(_sse(own))) == [own] and s.failure is None
    assert s.feed(_sse({"error": {"message": "engine dead", "code": 500}})) == []
    assert s.failure == "engine dead"


def test_the_prompt_ids_come_from_the_body_or_chat_tokens_when_no_event_had_them() -> None:
    assert Stitch({"prompt": [4, 5]}, "/v1/completions").why_not() is None
    assert Stitch({"messages": []}, "/v1/chat/completions", prompt_hint=[1]).why_not() is None
    assert "unknown" in (Stitch({"prompt": "t"}, "/v1/completions").why_not() or "")


def test_a_stream_that_had_its_last_token_gets_its_usage_and_done() -> None:
    body = {"prompt": [1, 2], "max_tokens": 2, "stream_options": {"include_usage": True}}
    s = Stitch(body, "/v1/completions")
    s.feed(_sse(_completion([3]), _completion([4], "length")))
    assert s.finish_reason == "length"
    events, _ = split_events(s.tail())
    assert events[0].data is not None
    assert events[0].data["usage"] == {
        "prompt_tokens": 2,
        "completion_tokens": 2,
        "total_tokens": 4,
    }
    assert events[-1].done
