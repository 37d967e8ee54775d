"""Mid-stream migration: a streamed answer whose decode fails after the client's first byte
goes on from another decode (docs/serving.md, "A decode that dies mid-stream").

The proxy asks decode for ``return_token_ids`` and reads every event it relays: the prompt's
ids (the first event carries them) and each generated token's. When decode breaks off (a
reset, a killed engine, an error event, a stream that ends without ``[DONE]``), the request
goes on as a ``/v1/completions`` request whose prompt is the prompt's ids plus the tokens the
client already has, with what is left of ``max_tokens`` and the same sampling settings; its
events are rewritten to continue the client's stream (its id, a chat stream's chunk shape,
usage over the whole answer). Nothing is re-tokenized, and only whole events are relayed and
counted, so no token is sent twice or lost.

Requests whose continuation would not be the same answer are not migrated (``refusal``): they
end with the error event, as before. This module is the pure part; flow.py makes the calls.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

# kvproxy_migrations_total's outcomes.
Outcome = Literal["resumed", "completed", "not_resumable", "limit", "budget", "no_instance"]

CHAT_CHUNK = "chat.completion.chunk"
COMPLETIONS_PATH = "/v1/completions"
# vLLM 0.32's CompletionRequest.max_tokens default (a chat request's is the context left,
# which a continuation without max_tokens gets from its own prompt, so it needs none).
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
# A chat request's fields that mean the same in a completions request (sampling, stopping on
# ids, detokenizing, caching): the continuation of a chat stream takes these, and no other.
SHARED_FIELDS = (
    "model",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop_token_ids",
    "ignore_eos",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "include_stop_str_in_output",
    "allowed_token_ids",
    "logit_bias",
    "priority",
    "user",
    "cache_salt",
    "stream_options",
)
# Fields whose effect depends on what was generated before: a continuation would restart it.
STATEFUL_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex")


class BrokenStream(Exception):
    """Decode's stream ended without finishing the answer (an error event, no ``[DONE]``, a
    non-200 continuation): handled as a reset is."""


def _nonzero(body: dict[str, Any], name: str, neutral: float) -> bool:
    value = body.get(name)
    return value is not None and value != neutral


def refusal(body: dict[str, Any], path: str) -> str | None:
    """Why a streamed request cannot be continued on another decode as the same answer (None:
    it can). Decided before it is sent: a refused request is relayed as it comes."""
    chat = "chat" in path
    if (body.get("n") or 1) != 1 or (body.get("best_of") or 1) != 1:
        return "several choices (n or best_of above 1)"
    if not chat and not _single_prompt(body.get("prompt")):
        return "several prompts in one request"
    for name in ("presence_penalty", "frequency_penalty"):
        if _nonzero(body, name, 0):
            return f"{name}: the tokens generated so far would become prompt, which it ignores"
    # repetition_penalty migrates: vLLM penalizes tokens of the prompt and the output alike,
    # and the continuation's prompt holds both.
    if body.get("bad_words"):
        return "bad_words: matched on output tokens only, one across the boundary is missed"
    # vLLM's default temperature is 1 (or the model's generation config): sampled, unless 0.
    if body.get("seed") is not None and body.get("temperature", 1) != 0:
        return "seeded sampling: the continuation's generator would restart from the seed"
    if body.get("stop"):
        return "stop strings: one across the boundary would be missed, and decode holds back text"
    if body.get("logprobs") or body.get("prompt_logprobs") is not None:
        return "logprobs: their offsets and shape restart with a continuation"
    if chat and body.get("tools") and body.get("tool_choice") != "none":
        return "tools: a tool call's parsing is the chat endpoint's, not a continuation's"
    for name in STATEFUL_FIELDS:
        if body.get(name) is not None and name != "response_format":
            return f"{name}: the grammar's state would restart"
    if body.get("response_format") not in (None, {"type": "text"}):
        return "response_format: the grammar's state would restart"
    return None


def _single_prompt(prompt: object) -> bool:
    if isinstance(prompt, str):
        return True
    if isinstance(prompt, list):
        return len(prompt) == 1 or all(isinstance(t, int) for t in prompt)
    return False


def _prompt_ids_in(body: dict[str, Any]) -> list[int] | None:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return list(prompt)
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
        return list(prompt[0])
    return None


def with_token_ids(body: dict[str, Any]) -> dict[str, Any]:
    """Decode's body: every event then carries its tokens' ids (and the first the prompt's)."""
    return {**body, "return_token_ids": True}


def remaining_max_tokens(body: dict[str, Any], chat: bool, generated: int) -> int | None:
    """``max_tokens`` for a continuation after ``generated`` tokens (None: the context left,
    as the request had)."""
    limit = body.get("max_completion_tokens", body.get("max_tokens")) if chat else None
    if not chat:
        limit = body.get("max_tokens", COMPLETIONS_DEFAULT_MAX_TOKENS)
    return None if limit is None else max(int(limit) - generated, 0)


@dataclass(frozen=True)
class Event:
    """One server-sent event as decode sent it: its bytes (separator included) and, when its
    data is a JSON object, that object."""

    raw: bytes
    data: dict[str, Any] | None
    done: bool = False


def split_events(buffer: bytes) -> tuple[list[Event], bytes]:
    """The whole events at the start of ``buffer``, and the rest (an event still coming)."""
    events = []
    while (end := buffer.find(b"\n\n")) >= 0:
        raw, buffer = buffer[: end + 2], buffer[end + 2 :]
        payload = raw.strip()
        if payload == b"data: [DONE]":
            events.append(Event(raw, None, done=True))
            continue
        data = None
        if payload.startswith(b"data:"):
            try:
                parsed = json.loads(payload[5:])
            except ValueError:
                parsed = None
            data = parsed if isinstance(parsed, dict) else None
        events.append(Event(raw, data))
    return events, buffer


def _dump(data: dict[str, Any]) -> bytes:
    # vLLM's pydantic dumps are compact and UTF-8: rewritten events look like its own.
    return (
        b"data: " + json.dumps(data, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"
    )


@dataclass
class Stitch:
    """One client stream across the decodes that serve it: what the client has, and how each
    decode's events are rewritten into that stream."""

    body: dict[str, Any]
    path: str
    prompt_hint: list[int] | None = None  # a chat request's ids from chat_tokens.py
    refused: str | None = None  # why it cannot be migrated (``refusal``): relayed as it comes
    prompt_ids: list[int] | None = None
    generated: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    done: bool = False
    migrations: int = 0
    # Tokens the client had when the current segment began (0: the first decode's).
    offset: int = 0
    failure: str | None = None  # decode's error event, when it sent one
    untracked: str | None = None  # why the tokens so far are not known exactly
    usage_sent: bool = False
    first: dict[str, Any] | None = None  # id, created, model of the client's stream
    _buffer: bytes = b""

    @property
    def chat(self) -> bool:
        return "chat" in self.path

    @property
    def wants_ids(self) -> bool:
        return bool(self.body.get("return_token_ids"))

    def feed(self, data: bytes) -> list[bytes]:
        """The bytes to relay for ``data`` from decode; stops at an error event (``failure``
        set: the caller migrates) and keeps a partial event until its end comes."""
        events, self._buffer = split_events(self._buffer + data)
        out = []
        for e in events:
            if self.failure is not None:
                break
            if e.done:
                self.done = True
                out.append(e.raw)
            elif e.data is None:
                out.append(e.raw)
            else:
                relayed = self._event(e)
                if relayed is not None:
                    out.append(relayed)
        return out

    def _event(self, e: Event) -> bytes | None:
        data = e.data
        assert data is not None
        error = data.get("error")
        if isinstance(error, dict):
            code = error.get("code")
            if not isinstance(code, int) or code >= 500:
                self.failure = str(error.get("message") or error)[:300]
                return None
            return e.raw  # the request's own fault: a continuation would fail alike
        if self.first is None:
            self.first = {k: data.get(k) for k in ("id", "created", "model")}
        choices = data.get("choices") or []
        prompt = data.get("prompt_token_ids")
        changed = False
        if prompt is not None:  # a chat stream's first event
            changed = True
            data["prompt_token_ids"] = prompt if self.wants_ids else None
            if self.prompt_ids is None:
                self.prompt_ids = list(prompt)
        for ch in choices:
            changed |= self._choice(ch)
        if self.offset and self.chat and data.get("object") != CHAT_CHUNK:
            data = self._as_chat(data)
            changed = True
        elif self.offset:
            data.update({k: v for k, v in self.first.items() if v is not None})
            changed = True
        usage = data.get("usage")
        if isinstance(usage, dict):
            self.usage_sent = not choices
            if self.offset:
                usage.update(self._usage(usage))
        return _dump(data) if changed else e.raw

    def _choice(self, ch: dict[str, Any]) -> bool:
        """Count one choice's tokens; whether it changed (ids the client did not ask for)."""
        changed = False
        prompt = ch.get("prompt_token_ids")
        if prompt is not None:  # a completions stream's first event
            if self.prompt_ids is None and self.offset == 0:
                self.prompt_ids = list(prompt)
            # A continuation's prompt is not the client's: only the first decode's is shown.
            shown = self.wants_ids and self.offset == 0
            ch["prompt_token_ids"] = prompt if shown else None
            changed = True
        ids = ch.get("token_ids")
        delta = ch.get("delta") or {}
        if ids is not None:
            self.generated.extend(ids)
            if not self.wants_ids:
                ch["token_ids"] = None
            changed = True
        elif ch.get("text") or delta.get("content"):
            self.untracked = "decode's events carry no token ids (return_token_ids unsupported)"
        if delta.get("tool_calls"):
            self.untracked = "a tool call in progress: its parsing would restart"
        if delta.get("reasoning") or delta.get("reasoning_content"):
            self.untracked = "reasoning in progress: a continuation's text would be content"
        if ch.get("finish_reason") is not None:
            self.finish_reason = ch["finish_reason"]
        return changed

    def _as_chat(self, data: dict[str, Any]) -> dict[str, Any]:
        """A continuation's completions event as the chat chunk the client's stream expects."""
        assert self.first is not None
        choices = []
        for ch in data.get("choices") or []:
            choice: dict[str, Any] = {
                "index": ch.get("index", 0),
                "delta": {"content": ch.get("text", "")},
                "logprobs": None,
                "finish_reason": ch.get("finish_reason"),
            }
            if "stop_reason" in ch:
                choice["stop_reason"] = ch["stop_reason"]
            if self.wants_ids:
                choice["token_ids"] = ch.get("token_ids")
            choices.append(choice)
        out: dict[str, Any] = {**self.first, "object": CHAT_CHUNK, "choices": choices}
        if data.get("usage") is not None:
            out["usage"] = data["usage"]
        return out

    def _usage(self, usage: dict[str, Any]) -> dict[str, Any]:
        """A continuation's usage over the whole answer: its prompt held ``offset`` tokens
        of the answer."""
        prompt = int(usage.get("prompt_tokens") or 0) - self.offset
        completion = int(usage.get("completion_tokens") or 0) + self.offset
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }

    def why_not(self) -> str | None:
        """Why the answer cannot go on from here (None: it can)."""
        if self.untracked is not None:
            return self.untracked
        if self.prompt_ids is None:
            self.prompt_ids = self.prompt_hint or _prompt_ids_in(self.body)
        if self.prompt_ids is None:
            return "the prompt's ids are unknown: decode broke off before its first event"
        return None

    def continuation(self) -> dict[str, Any]:
        """The ``/v1/completions`` body that goes on from the tokens the client has; the
        stream's next events are rewritten from here on."""
        assert self.prompt_ids is not None
        n = len(self.generated)
        if self.chat:
            out = {k: self.body[k] for k in SHARED_FIELDS if k in self.body}
        else:
            dropped = ("prompt", "echo", "max_tokens", "min_tokens", "kv_transfer_params")
            out = {k: v for k, v in self.body.items() if k not in dropped}
        limit = remaining_max_tokens(self.body, self.chat, n)
        if limit is not None:
            out["max_tokens"] = limit
        if self.body.get("min_tokens"):
            out["min_tokens"] = max(int(self.body["min_tokens"]) - n, 0)
        out.update(prompt=[*self.prompt_ids, *self.generated], stream=True, return_token_ids=True)
        self.offset = n
        self.migrations += 1
        self._buffer = b""  # a partial event of the failed decode is dropped with its tokens
        self.failure = None
        return out

    def tail(self) -> bytes:
        """The end of a stream whose last token the client has (decode broke off after it):
        the usage event it asked for, and ``[DONE]``."""
        out = b""
        options = self.body.get("stream_options") or {}
        ids = self.prompt_ids or self.prompt_hint or _prompt_ids_in(self.body)
        if options.get("include_usage") and not self.usage_sent and ids is not None:
            prompt, completion = len(ids), len(self.generated)
            usage = {
                "prompt_tokens": prompt,
                "completion_tokens": completion,
                "total_tokens": prompt + completion,
            }
            head = self.first or {}
            kind = CHAT_CHUNK if self.chat else "text_completion"
            out += _dump({**head, "object": kind, "choices": [], "usage": usage})
        self.done = True
        return out + b"data: [DONE]\n\n"
