"""``bench turns --api chat``: each turn as ``/v1/chat/completions`` with the conversation's
messages as text (issue 53, item 4).

A message's text is its workload token ids as words of the tiny models' WordLevel vocabulary
(``tiny_tokenizer.words``): the engines' tokenizer turns it back into the very ids, so a chat
turn adds as many tokens as the completions path's turn, plus the chat template's markers. The
assistant's earlier answers go back as the text the system streamed; every id survives
ids -> text -> ids there too, so the template keeps them as generated (``prefix_kept`` checks
it turn by turn from the engine's own ``prompt_token_ids``).

The tiny template (``tiny_tokenizer.CHAT_TEMPLATE``) renders each message as
``<|role|> words <|end|>`` and the generation prompt as ``<|assistant|>``: turn 1 adds 3 tokens
to its message (``<|user|>``, ``<|end|>``, ``<|assistant|>``), every later turn 4 (``<|end|>``
closing the previous answer, then those 3). ``template_tokens`` is what the engine's prompt
holds beyond the previous prompt, the previous answer and the new message's words.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from typing import Any

import httpx

from app.bench.turns.workload import Message
from app.harness.tiny_tokenizer import words

APIS = ("completions", "chat")
Chat = list[dict[str, str]]


def user_turn(history: Sequence[Mapping[str, str]], m: Message) -> Chat:
    """The messages of ``m``'s request: the conversation so far and ``m`` as the user's text."""
    return [*map(dict, history), {"role": "user", "content": words(m.tokens)}]


def answered(sent: Sequence[Mapping[str, str]], answer: str) -> Chat:
    """The conversation after the assistant answered ``answer`` to ``sent``."""
    return [*map(dict, sent), {"role": "assistant", "content": answer}]


def template_tokens(prompt_tokens: int, new_tokens: int, before: Mapping[str, Any] | None) -> int:
    """The prompt's tokens beyond the new message's words and, after turn 1, the previous
    turn's prompt and answer (``before``: that turn's row)."""
    held = 0 if before is None else before["prompt_tokens"] + len(before["answer"])
    return prompt_tokens - held - new_tokens


def prefix_kept(prompt_ids: Sequence[int] | None, before: Mapping[str, Any] | None) -> bool | None:
    """Whether the prompt starts with the previous turn's prompt and the ids it generated
    (None: turn 1, or the engine did not return the prompt's ids)."""
    if before is None or prompt_ids is None or before.get("prompt_ids") is None:
        return None
    held = [*before["prompt_ids"], *before["answer"]]
    return list(prompt_ids[: len(held)]) == held


async def stream_chat(
    client: httpx.AsyncClient, url: str, messages: Sequence[Mapping[str, str]], max_tokens: int
) -> dict[str, Any]:
    """One streamed greedy chat completion of exactly ``max_tokens`` (EOS ignored): when it
    was sent, its first and last token's arrival (``time.time()``), its token ids and text, and
    the prompt's ids and length as the engine rendered them (None where it did not say)."""
    body = {
        "model": "tiny",
        "messages": list(messages),
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }
    sent, first, last = time.time(), None, None
    tokens: list[int] = []
    text: list[str] = []
    prompt_ids: list[int] | None = None
    prompt_tokens: int | None = None
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("prompt_token_ids"):
                prompt_ids = list(event["prompt_token_ids"])
            if event.get("usage"):
                prompt_tokens = int(event["usage"]["prompt_tokens"])
            for choice in event.get("choices") or []:
                text.append(choice.get("delta", {}).get("content") or "")
                ids = choice.get("token_ids") or []
                if ids:
                    last = time.time()
                    first = first or last
                    tokens += ids
    if prompt_tokens is None and prompt_ids is not None:
        prompt_tokens = len(prompt_ids)
    return {
        "sent": sent,
        "first": first,
        "last": last,
        "tokens": tokens,
        "text": "".join(text),
        "prompt_ids": prompt_ids,
        "prompt_tokens": prompt_tokens,
    }
