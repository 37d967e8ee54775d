"""The router's own key for a token prefix: what a vLLM block hash stands for.

vLLM's block hash is ``hash(parent hash, the block's token ids, extra keys)`` under a hash
function and seed the router does not share, so the router cannot compute it. What it can
compute is its own chain over the same tokens: the key of a prefix of ``k * unit`` tokens is
``hash(key of the first (k - 1) * unit tokens, the k-th unit's token ids[, opaque extras])``,
starting from a root that names the LoRA adapter and the cache salt. A ``BlockStored`` event
carries its blocks' token ids and the hash of the block before them, so the index learns the
key of every vLLM hash it sees, and a prompt's keys can be looked up without vLLM's hash.

Keys step by ``unit`` tokens, not by block, so one prefix has one key at any block size: vLLM
hashes every group's blocks as a prefix fingerprint at ``hash_block_size`` granularity (a block
of a group with bigger blocks takes the hash at its last ``hash_block_size`` boundary), and
``unit`` must divide every block size the engine publishes (its ``hash_block_size``, or a
divisor of it).

Extra keys: the LoRA name (every block) and the cache salt (first block) become the root.
Multimodal ``(identifier, offset)`` pairs and prompt-embeds digests are mixed into their
block's units as they come: the router has neither, so such blocks and their descendants never
match a lookup, which is right, as the router cannot name those prompts anyway.

Keys use Python's ``hash`` under a per-process random secret (fast: a unit of 16 token ids is
one C-level tuple hash). They are not cryptographic: a collision could only misroute a request.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# vLLM's block size on GPUs (its CPU default, 128, and the usual sizes are multiples of it).
DEFAULT_UNIT = 16


@dataclass(frozen=True)
class KeyScheme:
    """How prefixes are keyed: shared by the indexes and the lookups that ask them."""

    unit: int  # tokens per key step
    secret: int  # random per process, so keys cannot be aimed at from outside

    @classmethod
    def new(cls, unit: int = DEFAULT_UNIT) -> KeyScheme:
        if unit <= 0:
            raise ValueError(f"expected a key unit of at least 1 token; got {unit}")
        return cls(unit, secrets.randbits(64))

    def root(self, lora_name: str | None, cache_salt: str | None) -> int:
        """The key of the empty prefix of a prompt under this adapter and salt."""
        return hash((self.secret, lora_name, cache_salt))

    def extend(self, key: int, token_ids: Sequence[int], opaque: Any = None) -> list[int]:
        """The keys at every unit boundary of ``token_ids`` (a whole number of units) after
        the prefix keyed ``key``; ``opaque`` (hashable) is mixed into each of them."""
        u = self.unit
        if len(token_ids) % u:
            raise ValueError(f"expected whole units of {u} tokens; got {len(token_ids)} tokens")
        out: list[int] = []
        for i in range(0, len(token_ids), u):
            unit_ids = tuple(token_ids[i : i + u])
            key = hash((key, unit_ids) if opaque is None else (key, unit_ids, opaque))
            out.append(key)
        return out

    def prompt(
        self, token_ids: Sequence[int], lora_name: str | None = None, cache_salt: str | None = None
    ) -> PromptKeys:
        """A prompt's keys, one per whole unit (a trailing part unit has none)."""
        whole = len(token_ids) - len(token_ids) % self.unit
        keys = self.extend(self.root(lora_name, cache_salt), token_ids[:whole])
        return PromptKeys(self, tuple(keys))


@dataclass(frozen=True)
class PromptKeys:
    """``keys[k - 1]``: the key of the prompt's first ``k * scheme.unit`` tokens."""

    scheme: KeyScheme
    keys: tuple[int, ...]

    @property
    def tokens(self) -> int:
        return len(self.keys) * self.scheme.unit


def _hashable(x: Any) -> Any:
    return tuple(_hashable(v) for v in x) if isinstance(x, list | tuple) else x


def split_extra_keys(entry: Sequence[Any] | None, lora_name: str | None) -> tuple[str | None, Any]:
    """One block's published extra keys as ``(cache salt, opaque rest)``.

    vLLM publishes them untagged, in order: the LoRA name (when the event's ``lora_name`` is
    set), ``(mm_identifier, offset)`` pairs, the cache salt (a string, first block only), then
    prompt-embeds digests (bytes). The LoRA name is the event's own field; the salt is the only
    other string; everything else is opaque to the router."""
    if not entry:
        return None, None
    rest = list(entry)
    if lora_name is not None and rest and rest[0] == lora_name:
        rest = rest[1:]
    salts = [e for e in rest if isinstance(e, str)]
    opaque = tuple(_hashable(e) for e in rest if not isinstance(e, str))
    return (salts[0] if salts else None), (opaque or None)
