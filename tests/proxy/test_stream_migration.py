"""A stream whose decode breaks off after the client's first byte goes on from another decode
(app/proxy/migration.py, resume.py), over HTTP fakes of vLLM whose streams carry token ids:
token k of prompt + answer is TOKEN_BASE + k, so a stitched answer is contiguous exactly when
no token is repeated or missing."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from tests.proxy.conftest import TOKEN_BASE, Cluster, sample

PROMPT = [1, 2, 3]


def _events(text: str) -> list[Any]:
    out: list[Any] = []
    for e in text.split("\n\n"):
        if e:
            data = e.removeprefix("data: ")
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def _ids(events: list[Any]) -> list[int]:
    return [
        t
        for e in events
        if isinstance(e, dict)
        for ch in e.get("choices") or []
        for t in ch.get("token_ids") or []
    ]


def _cluster(make_cluster: Callable[..., Cluster], **cfg: Any) -> Cluster:
    c = make_cluster(n_prefill=1, n_decode=2).start_proxy(decode_policy="round_robin", **cfg)
    for d in c.decode:
        d.behaviour.token_ids = True
    return c


def test_a_broken_completions_stream_goes_on_from_the_other_decode(
    make_cluster: Callable[..., Cluster],
) -> None:
    c = _cluster(make_cluster)
    d0, d1 = c.decode
    d0.behaviour.break_after = 2
    r = c.post(
        prompt=PROMPT,
        max_tokens=4,
        temperature=0,
        stream=True,
        return_token_ids=True,
        stream_options={"include_usage": True},
    )
    events = _events(r.text)
    assert r.status_code == 200 and events[-1] == "[DONE]"
    assert not [e for e in events if isinstance(e, dict) and "error" in e]
    want = [TOKEN_BASE + len(PROMPT) + k for k in range(4)]
    assert _ids(events) == want  # two from d0, two from d1: none twice, none missing
    assert {e["id"] for e in events[:-1]} == {"fake-3"}  # one stream id throughout
    assert events[-2]["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    assert events[-3]["choices"][0]["finish_reason"] == "length"
    (seen,) = d1.requests
    assert (seen.path, seen.body["prompt"]) == ("/v1/completions", [*PROMPT, *want[:2]])
    assert (seen.body["max_tokens"], seen.body["temperature"]) == (2, 0)
    first = c.record(r.headers["x-kv-transfer-id"])
    assert (first["status"], first["decode"]) == ("decode_failed", d0.url)
    cont = c.record(first["retried_as"])
    assert (cont["migrated_at_token"], cont["migrated_from"], cont["decode"]) == (2, d0.url, d1.url)
    assert (cont["attempts"], cont["retries"][0]["reason"]) == (2, "mid_stream")
    m = c.metrics()
    assert sample(m, "kvproxy_migrations_total", outcome="resumed") == 1
    # The client's one request, counted once, when its last part ended.
    labels = {"route": "/v1/completions", "decision": "disaggregated", "reason": ""}
    assert sample(m, "kvproxy_requests_total", **labels, outcome="ok") == 1
    assert sample(m, "kvproxy_requests_total", **labels, outcome="broken") is None


def test_the_ids_the_client_did_not_ask_for_are_not_shown(
    make_cluster: Callable[..., Cluster],
) -> None:
    c = _cluster(make_cluster)
    c.decode[0].behaviour.break_after = 1
    r = c.post(prompt=PROMPT, max_tokens=3, stream=True)
    events = _events(r.text)
    assert events[-1] == "[DONE]" and len(events) == 4, events
    assert [e["choices"][0]["text"] for e in events[:-1]] == [" w5003", " w5004", " w5005"]
    assert all(e["choices"][0].get("token_ids") is None for e in events[:-1])
    assert all(e["choices"][0].get("prompt_token_ids") is None for e in events[:-1])
    assert c.decode[0].requests[0].body["return_token_ids"] is True  # asked of decode


def test_a_chat_stream_goes_on_as_chat_chunks(make_cluster: Callable[..., Cluster]) -> None:
    c = _cluster(make_cluster, chat_tokens=False)
    d0, d1 = c.decode
    d0.behaviour.break_after = 3  # the role chunk and two tokens
    r = c.post(
        "/v1/chat/completions",
        messages=[{"role": "user", "content": "hi"}],
        max_completion_tokens=4,
        temperature=0,
        stream=True,
    )
    events = _events(r.text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert {(e["object"], e["id"]) for e in chunks} == {("chat.completion.chunk", "fake-3")}
    content = "".join(e["choices"][0]["delta"].get("content") or "" for e in chunks)
    assert content == " w5003 w5004 w5005 w5006"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    (seen,) = d1.requests
    assert seen.path == "/v1/completions" and "messages" not in seen.body
    assert (seen.body["prompt"], seen.body["max_tokens"]) == ([1, 2, 3, 5003, 5004], 2)


def test_an_error_event_mid_stream_is_migrated(make_cluster: Callable[..., Cluster]) -> None:
    c = _cluster(make_cluster)
    c.decode[0].behaviour.error_after = 2
    r = c.post(prompt=PROMPT, max_tokens=4, stream=True, return_token_ids=True)
    events = _events(r.text)
    assert _ids(events) == [5003, 5004, 5005, 5006] and events[-1] == "[DONE]"
    assert not [e for e in events if isinstance(e, dict) and "error" in e]


def test_a_request_that_cannot_be_resumed_ends_with_the_error_event(
    make_cluster: Callable[..., Cluster],
) -> None:
    c = _cluster(make_cluster)
    d0, d1 = c.decode
    d0.behaviour.break_after = 2
    r = c.post(prompt=PROMPT, max_tokens=4, stream=True, presence_penalty=0.5)
    events = _events(r.text)
    assert events[-1]["error"]["code"] == 502 and not d1.requests
    assert "return_token_ids" not in d0.requests[0].body  # relayed as it comes
    assert sample(c.metrics(), "kvproxy_migrations_total", outcome="not_resumable") == 1


def test_the_limit_bounds_migrations(make_cluster: Callable[..., Cluster]) -> None:
    c = _cluster(make_cluster)
    for d in c.decode:
        d.behaviour.break_after = 1
    r = c.post(prompt=PROMPT, max_tokens=4, stream=True, return_token_ids=True)
    events = _events(r.text)
    assert _ids(events) == [5003, 5004]  # one from each decode, then the error
    assert events[-1]["error"]["code"] == 502
    assert sample(c.metrics(), "kvproxy_migrations_total", outcome="limit") == 1


def test_migration_limit_zero_keeps_the_error_event(make_cluster: Callable[..., Cluster]) -> None:
    c = _cluster(make_cluster, migration_limit=0)
    d0, d1 = c.decode
    d0.behaviour.break_after = 2
    r = c.post(prompt=PROMPT, max_tokens=4, stream=True)
    assert _events(r.text)[-1]["error"]["code"] == 502 and not d1.requests
    assert "return_token_ids" not in d0.requests[0].body


def test_a_stream_broken_after_its_last_token_is_ended_by_the_proxy(
    make_cluster: Callable[..., Cluster],
) -> None:
    c = _cluster(make_cluster)
    d0, d1 = c.decode
    d0.behaviour.break_after = 4  # every token sent; the usage event and [DONE] never come
    r = c.post(prompt=PROMPT, max_tokens=4, stream=True, stream_options={"include_usage": True})
    events = _events(r.text)
    assert events[-1] == "[DONE]" and not d1.requests
    assert events[-2]["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    assert sample(c.metrics(), "kvproxy_migrations_total", outcome="completed") == 1
