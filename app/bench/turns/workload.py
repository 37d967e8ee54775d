"""The conversations of ``bench turns`` (pure, seeded).

Each conversation opens with a prompt of ``first_tokens`` (a system prompt and the first
message). Every later turn adds one message to the history (the earlier prompts and the answers
the system gave): a short follow-up (``short`` tokens) or a long tool output (``long`` tokens),
the long ones with probability ``long_share``. Every turn generates ``answer_tokens``.

Only the new messages are fixed here; the history is what each system answered, as a client
would send it, so its length is the same for every system and its tokens may differ where a
system answered otherwise.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from app.bench.core.workload import random_tokens
from app.errors import ConfigError


@dataclass(frozen=True)
class TurnsWorkload:
    conversations: int = 12  # issue 52: the bootstrap resamples conversations; 12 at least
    turns: int = 4
    first_tokens: int = 1536
    short: tuple[int, int] = (16, 64)  # a follow-up's tokens, lowest and highest
    long: tuple[int, int] = (192, 384)  # a tool output's
    long_share: float = 0.5  # of the turns after the first
    answer_tokens: int = 64  # an agent's tool call, a short reply
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("conversations", "turns", "first_tokens", "answer_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("short", "long"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ConfigError(
                    f"{name} must be (lowest, highest) with 1 <= lowest <= highest, got {(lo, hi)}"
                )
        if not 0 <= self.long_share <= 1:
            raise ConfigError(f"long_share must be in [0, 1], got {self.long_share}")

    @property
    def longest_prompt(self) -> int:
        """Tokens of the longest last turn: every message long."""
        return self.first_tokens + (self.turns - 1) * (self.long[1] + self.answer_tokens)


@dataclass(frozen=True)
class Message:
    """Turn ``turn`` (1-based) of conversation ``conversation``: the tokens it adds."""

    conversation: int
    turn: int
    tokens: tuple[int, ...]
    long: bool


def conversations(w: TurnsWorkload, salt: int = 0) -> list[list[Message]]:
    """Every conversation's messages in turn order; ``salt`` draws other tokens of the same
    lengths (a second run on the same engines hits nothing of the first)."""
    lengths = random.Random(f"turns/{w.seed}")
    tokens = random.Random(f"turns/{w.seed}/{salt}")
    out = []
    for c in range(w.conversations):
        msgs = []
        for t in range(1, w.turns + 1):
            if t == 1:
                n, long = w.first_tokens, True
            else:
                long = lengths.random() < w.long_share
                n = lengths.randint(*(w.long if long else w.short))
            body = random_tokens(tokens, n)
            msgs.append(Message(c, t, body, long))
        out.append(msgs)
    return out


def in_turn_order(convs: list[list[Message]]) -> list[Message]:
    """Turn 1 of every conversation, then turn 2 of every one, ...: the conversations
    interleave, so each turn finds the others' KV in the caches, as on a shared service."""
    return [m for turn in zip(*convs, strict=True) for m in turn]
