"""Chat requests as token ids at the proxy, rendered by vLLM itself (issue 53, items 1 and 2).

The proxy has no tokenizer of its own: a chat request's messages are sent to an engine's
``/tokenize``, which renders them through the same code path as ``/v1/chat/completions``
(vLLM's ``OnlineRenderer.preprocess_chat``: the model's chat template, then its tokenizer).
The ids then route the request as a token prompt would be routed (the precise index, the pool
tier, the decode-alone rule, ``cost_tokens``), and go to prefill and decode in
``kv_transfer_params["prompt_token_ids"]``, which vLLM 0.32's chat completions take instead
of rendering (``online_renderer._reused_prompt_token_ids``): both engines compute on the very
ids that were routed.

``/tokenize`` takes fewer fields than a chat completion. What the chat path would template
differently is mapped or refused:

- ``documents`` and ``reasoning_effort`` go into ``chat_template_kwargs`` as the chat path
  puts them there (``ChatCompletionRequest.build_chat_params``, ``enable_thinking`` too);
- ``tool_choice`` other than ``auto`` with ``tools``, and any ``response_format``: refused,
  since a renderer may template them (vLLM's Kimi K3 renderer does) or drop the tools
  (``tool_choice: none`` under ``--exclude-tools-when-tool-choice-none``), which ``/tokenize``
  cannot be told;
- ``truncate_prompt_tokens``: refused, the engine cuts a rendered prompt but not forwarded ids;
- content parts other than text (images, audio, ...): refused, vLLM renders those itself and
  ignores forwarded ids;
- a batch of conversations: refused, vLLM takes one forwarded prompt per request.

A refusal, a slow or failed ``/tokenize`` or an unusable answer falls back to the text
routing the proxy did before (``Fallback.reason`` is the metric's label); the request itself
is unchanged and the engines render it.

Ids are cached per render input (the canonical JSON of the ``/tokenize`` body, the model
included), least recently used evicted first, bounded in entries and in ids held.
"""

from __future__ import annotations

import array
import asyncio
import hashlib
import itertools
import json
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import httpx

from app.proxy.dp import upstream

# The labels of kvproxy_chat_tokens_fallbacks_total.
FIELD = "field"  # a chat field /tokenize cannot be told about
NON_TEXT = "non_text"
BATCH = "batch"
INVALID = "invalid"  # messages that are not a list of objects: the engine answers the 400
TOO_LARGE = "too_large"
NO_INSTANCE = "no_instance"
TIMEOUT = "timeout"
UNREACHABLE = "unreachable"
ENGINE_REFUSED = "engine_refused"
BAD_ANSWER = "bad_answer"
REASONS = (
    FIELD,
    NON_TEXT,
    BATCH,
    INVALID,
    TOO_LARGE,
    NO_INSTANCE,
    TIMEOUT,
    UNREACHABLE,
    ENGINE_REFUSED,
    BAD_ANSWER,
)

# Chat fields /tokenize takes as they are.
_PASSED = (
    "model",
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "chat_template",
    "tools",
)
# Values vLLM's merge_kwargs treats as unset.
_UNSET = (None, "auto")
_TEXT_PART_KEYS = frozenset({"type", "text"})
# Ids are kept as 32-bit integers (every vocabulary fits).
_ID_MAX = (1 << 31) - 1


@dataclass(frozen=True)
class ChatTokenSettings:
    timeout_s: float = 2.0  # the whole /tokenize call, connection included
    max_bytes: int = 1 << 20  # largest /tokenize body sent (the messages as JSON)
    cache_entries: int = 4096
    cache_tokens: int = 8_000_000  # ids held by the cache, all entries together (4 bytes each)


@dataclass(frozen=True)
class ChatPrompt:
    """The ids vLLM renders a chat request to, and where they came from (``engine``: its
    ``/tokenize`` now, ``cache``: an earlier answer)."""

    ids: tuple[int, ...]
    source: str
    call_s: float | None = None  # the /tokenize call's time (None: none made)


@dataclass(frozen=True)
class Fallback:
    """Why a chat request is routed as text: ``reason`` (one of ``REASONS``) and the detail."""

    reason: str
    detail: str
    call_s: float | None = None  # the /tokenize call's time (None: none made)


def _text_only(messages: list[Any]) -> bool:
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            for part in content:
                if not isinstance(part, dict) or part.get("type", "text") != "text":
                    return False
                if not set(part) <= _TEXT_PART_KEYS:
                    return False
    return True


def tokenize_body(body: dict[str, Any]) -> dict[str, Any] | Fallback:
    """The ``/tokenize`` body that renders ``body`` (a chat completion) as the chat path
    would, or why none can."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return Fallback(INVALID, "messages: expected a non-empty list of message objects")
    if all(isinstance(m, list) for m in messages):
        return Fallback(BATCH, "messages: a batch of conversations (vLLM renders each itself)")
    if not all(isinstance(m, dict) for m in messages):
        return Fallback(INVALID, "messages: expected a list of message objects")
    if not _text_only(messages):
        return Fallback(NON_TEXT, "messages hold non-text content, which vLLM renders itself")
    if body.get("response_format") is not None:
        return Fallback(FIELD, "response_format: a renderer may template it, /tokenize takes none")
    if body.get("tools") and body.get("tool_choice") not in _UNSET:
        return Fallback(
            FIELD,
            f"tool_choice {body.get('tool_choice')!r} with tools: a renderer may template it "
            "or drop the tools, /tokenize takes none (expected auto, or no tool_choice)",
        )
    if body.get("truncate_prompt_tokens") is not None:
        return Fallback(FIELD, "truncate_prompt_tokens: vLLM cuts rendered prompts only")
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        return Fallback(INVALID, "chat_template_kwargs: expected an object")
    # As ChatCompletionRequest.build_chat_params merges them: set ones win over the client's.
    merged = dict(kwargs or {})
    for name in ("documents", "reasoning_effort"):
        if (value := body.get(name)) not in _UNSET:
            merged[name] = value
    effort = body.get("reasoning_effort")
    if effort is not None and "enable_thinking" not in (kwargs or {}):
        merged["enable_thinking"] = effort != "none"
    out: dict[str, Any] = {"messages": messages}
    out.update({k: body[k] for k in _PASSED if body.get(k) is not None})
    if merged:
        out["chat_template_kwargs"] = merged
    return out


def render_key(tokenize: dict[str, Any]) -> bytes:
    """The cache key of a ``/tokenize`` body: a digest of its canonical JSON (sorted keys,
    no spaces), so that a long conversation is not held twice."""
    canonical = json.dumps(tokenize, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.blake2b(canonical.encode(), digest_size=20).digest()


class IdCache:
    """Rendered ids by render key, least recently used evicted first; at most ``entries``
    entries and ``tokens`` ids in all."""

    def __init__(self, entries: int, tokens: int) -> None:
        self.max_entries = entries
        self.max_tokens = tokens
        self.tokens = 0
        self._items: OrderedDict[bytes, array.array[int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def get(self, key: bytes) -> tuple[int, ...] | None:
        ids = self._items.get(key)
        if ids is None:
            return None
        self._items.move_to_end(key)
        return tuple(ids)

    def put(self, key: bytes, ids: tuple[int, ...]) -> None:
        if len(ids) > self.max_tokens:
            return  # would evict everything else and still not fit
        old = self._items.pop(key, None)
        if old is not None:
            self.tokens -= len(old)
        self._items[key] = array.array("i", ids)
        self.tokens += len(ids)
        while len(self._items) > self.max_entries or self.tokens > self.max_tokens:
            _, dropped = self._items.popitem(last=False)
            self.tokens -= len(dropped)


def _ids_of(answer: Any) -> tuple[int, ...] | None:
    tokens = answer.get("tokens") if isinstance(answer, dict) else None
    if not isinstance(tokens, list) or not tokens:
        return None
    if not all(type(t) is int and 0 <= t <= _ID_MAX for t in tokens):
        return None
    return tuple(tokens)


class ChatTokens:
    """Renders chat requests to ids through the engines' ``/tokenize`` (``urls``: the
    instances that may be asked now, taken in turn), with a cache."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        urls: Callable[[], list[str]],
        settings: ChatTokenSettings,
    ) -> None:
        self.client = client
        self.urls = urls
        self.settings = settings
        self.cache = IdCache(settings.cache_entries, settings.cache_tokens)
        self._turn = itertools.count()

    async def prompt(self, body: dict[str, Any], headers: dict[str, str]) -> ChatPrompt | Fallback:
        """``body``'s ids (a chat completion), or why it is routed as text; ``headers`` are
        the client's forwarded ones (an engine's ``--api-key`` guards ``/tokenize`` too)."""
        request = tokenize_body(body)
        if isinstance(request, Fallback):
            return request
        raw = json.dumps(request, separators=(",", ":"), ensure_ascii=False).encode()
        if len(raw) > self.settings.max_bytes:
            return Fallback(
                TOO_LARGE,
                f"messages of {len(raw)} bytes as JSON: at most {self.settings.max_bytes} "
                "are tokenized",
            )
        key = render_key(request)
        cached = self.cache.get(key)
        if cached is not None:
            return ChatPrompt(cached, "cache")
        urls = self.urls()
        if not urls:
            return Fallback(NO_INSTANCE, "no instance available to tokenize")
        url = urls[next(self._turn) % len(urls)]
        t0 = time.perf_counter()
        got = await self._tokenize(url, raw, headers)
        call_s = time.perf_counter() - t0
        if isinstance(got, Fallback):
            return replace(got, call_s=call_s)
        self.cache.put(key, got)
        return ChatPrompt(got, "engine", call_s)

    async def _tokenize(
        self, url: str, raw: bytes, headers: dict[str, str]
    ) -> tuple[int, ...] | Fallback:
        base, rank = upstream(url)
        limit = self.settings.timeout_s
        try:
            async with asyncio.timeout(limit):
                r = await self.client.post(
                    f"{base}/tokenize",
                    content=raw,
                    headers={**headers, **rank, "content-type": "application/json"},
                    timeout=limit,
                )
        except (TimeoutError, httpx.TimeoutException):
            return Fallback(TIMEOUT, f"{url}/tokenize did not answer within {limit:g} s")
        except httpx.HTTPError as e:
            return Fallback(UNREACHABLE, f"{url}/tokenize failed: {type(e).__name__}: {e}")
        if r.status_code != 200:
            return Fallback(
                ENGINE_REFUSED, f"{url}/tokenize answered {r.status_code}: {r.text[:200]}"
            )
        try:
            ids = _ids_of(r.json())
        except ValueError:
            ids = None
        if ids is None:
            return Fallback(
                BAD_ANSWER,
                f"{url}/tokenize answered {r.text[:200]!r}: expected tokens, a non-empty list "
                "of non-negative 32-bit integers",
            )
        return ids
