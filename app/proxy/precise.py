"""Where the hit comes from: an engine's own KV events when they can be trusted, else the guess.

For each candidate instance the router asks ``EngineHits.answer``. The answer is *precise*
(``source="kv_events"``) when all of these hold:

- the instance publishes KV events to the proxy (``--kv-events URL=ENDPOINT``);
- its index is consistent (it saw every batch since a state it knew whole, index.py);
- the request's prompt is token ids (the proxy has no tokenizer: a text prompt's tokens are
  not known, so its blocks cannot be keyed as the engine keys them).

The hit is then what vLLM's coordinator accepts across every group of the device medium
(engine_hit.py): full attention's leading blocks, a sliding window's needed tail, Mamba's state
at an aligned point. Otherwise the answer says why not, and the pool uses the approximate
``PrefixIndex`` for that instance (``source="approximate"``) until the index is whole again.
The pool raises a precise hit where a request in flight on the instance shares more of the
prompt than its events show yet (balancer.py, ``source="in_flight"``).

The request's ``model`` is taken as a LoRA adapter's name when the engine has published
blocks under that name (vLLM's events carry the adapter's name, not the base model's); a
``cache_salt`` in the body roots the keys as vLLM roots its hashes.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from app.proxy.kv_events.engine_hit import coordinator_kind, engine_hit
from app.proxy.kv_events.feed import KvEventFeed
from app.proxy.kv_events.index import GroupHit, GroupId
from app.proxy.kv_events.keys import PromptKeys
from app.proxy.routing import RequestShape

KV_EVENTS = "kv_events"
# The events' hit raised by a request in flight on the instance sharing more of the prompt.
IN_FLIGHT = "in_flight"
APPROXIMATE = "approximate"
# vLLM's medium for the engine's own KV cache (offloading connectors publish CPU, STORAGE).
DEVICE_MEDIUM = "GPU"


@dataclass(frozen=True)
class PreciseHit:
    """The hit an engine's coordinator will take, from its events."""

    tokens: int
    groups: dict[str, int]  # "<group>/<medium>" -> the hit that group alone allows
    limited_by: str | None  # the group that stopped the hit short of the prompt
    # The largest block size the engine published (None: nothing stored yet), and whether
    # every group is full attention (MLA included): only then does a prompt in flight there
    # promise its shared prefix whole (a window or Mamba group keeps only its tail).
    block_size: int | None = None
    full_attention_only: bool = True


@dataclass(frozen=True)
class NoPreciseHit:
    """Why an instance's hit is the approximate guess this time."""

    why: str


def _name(gid: GroupId) -> str:
    return f"{gid.group}/{gid.medium}"


def device_groups(hits: Iterable[GroupHit]) -> list[GroupHit]:
    """The groups of the engine's own cache: medium GPU, or no medium when none says GPU."""
    hits = list(hits)
    device = [h for h in hits if h.group.medium == DEVICE_MEDIUM]
    return device or [h for h in hits if h.group.medium is None]


class EngineHits:
    """Precise hits for the instances whose KV events the feed follows (keyed by URL)."""

    def __init__(self, feed: KvEventFeed) -> None:
        self.feed = feed
        # The last request's keys, by LoRA name: decode's pick and prefill's ask about the
        # same request, and keying a long prompt hashes every unit of it.
        self._keyed: tuple[RequestShape, dict[str | None, PromptKeys]] | None = None

    def follows(self, url: str) -> bool:
        return url in self.feed.subscribers

    def answer(
        self, shape: RequestShape, urls: Iterable[str]
    ) -> dict[str, PreciseHit | NoPreciseHit]:
        """Per URL the feed follows, the precise hit or why there is none."""
        urls = [u for u in urls if self.follows(u)]
        if not urls:
            return {}
        if shape.token_ids is None:
            why = NoPreciseHit("text prompt: the proxy has no tokenizer to key its blocks")
            return {u: why for u in urls}
        out: dict[str, PreciseHit | NoPreciseHit] = {}
        if self._keyed is None or self._keyed[0] is not shape:
            self._keyed = (shape, {})
        keyed = self._keyed[1]
        for url in urls:
            index = self.feed.index(url)
            if not index.consistent:
                out[url] = NoPreciseHit(f"KV event index inconsistent: {index.reason}")
                continue
            lora = shape.model if shape.model in index.lora_names else None
            keys = keyed.get(lora)
            if keys is None:
                keys = keyed[lora] = self.feed.scheme.prompt(
                    shape.token_ids, lora, shape.cache_salt
                )
            groups = device_groups(index.lookup(keys))
            hit = engine_hit(groups, len(shape.token_ids))
            if hit.unsupported is not None:
                out[url] = NoPreciseHit(hit.unsupported)
                continue
            out[url] = PreciseHit(
                block_size=max((g.block_size for g in groups), default=None),
                # Kinds whose blocks a prompt keeps from its first token on.
                full_attention_only=all(
                    coordinator_kind(g.kind) in ("full_attention", "mla") for g in groups
                ),
                tokens=hit.tokens,
                groups={_name(g): t for g, t in hit.groups},
                limited_by=None if hit.limited_by is None else _name(hit.limited_by),
            )
        return out
