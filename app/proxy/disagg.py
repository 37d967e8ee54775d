"""Conditional disaggregation: whether a request is worth a prefill instance at all.

Decode is picked first; then the request is served by decode alone ("local": a plain request,
no ``kv_transfer_params``, decode computes the prompt with its own prefix cache, and with the
sidecar pool on its connector loads pool hits by itself) when

- the prompt is short: fewer than ``min_prefill_tokens`` tokens (0 turns the rule off), since
  a transfer's fixed costs (a second engine request, the target's round trip, the sidecar's
  per-layer pushes) then outweigh computing the prompt where it is; or
- the picked decode already holds most of it: the leading blocks the proxy routed to that
  decode before (its prefix index, ``routing.PrefixIndex``) cover at least
  ``decode_hit_fraction`` of the prompt (above 1 turns the rule off), since decode then
  computes only the rest, and a transfer would move little.

A prompt sent as embeddings (``prompt_embeds``) is always served by decode alone: the connectors
move no KV for it (there are no token ids to bind a target to or to key a pool block by), so a
prefill would compute it for nothing.

Otherwise prefill computes the prompt and pushes its KV to decode (README "Request flows").

A request that needs a prefill when no prefill instance can take one (all unhealthy, or
their breakers open) is served by decode alone too, as a short one is (kind ``no_prefill``,
the reason names the instances tried): decode computes the whole prompt, slower than a
transfer but an answer, where a 503 would fail a request decode can serve. An operator who
would rather shed that load (decode's running requests slow down while it computes long
prompts) sets ``--without-prefill refuse`` and gets the 503 back.
"""

from __future__ import annotations

from dataclasses import dataclass

from app.proxy.routing import Pick, RequestShape


@dataclass(frozen=True)
class Decision:
    """Whether one request goes through prefill, and why (shown in its transfer record)."""

    disaggregated: bool
    reason: str
    # "short", "cached", "embeds", "no_prefill" (all local) or "disaggregated": the /health
    # counter.
    kind: str


@dataclass(frozen=True)
class DisaggRules:
    """The two thresholds (``--min-prefill-tokens``, ``--decode-hit-fraction``)."""

    min_prefill_tokens: int = 256
    decode_hit_fraction: float = 0.8

    @property
    def tracks_decode_prefixes(self) -> bool:
        """Whether decode instances need a prefix index (the hit rule is on)."""
        return self.decode_hit_fraction <= 1

    def decide(self, shape: RequestShape, decode_pick: Pick | None) -> Decision:
        """The decision for a request whose decode is already picked (``decode_pick``)."""
        m = shape.prompt_tokens
        if shape.embeds:
            # The connectors move no KV for embeddings: a prefill would compute them for nothing.
            return Decision(False, "prompt embeddings: no KV to move", "embeds")
        if m < self.min_prefill_tokens:
            return Decision(False, f"short prompt: {m} < {self.min_prefill_tokens} tokens", "short")
        # The pick's hit was looked up before this prompt joined the decode's index.
        hit = None if decode_pick is None else decode_pick.hit_tokens
        if self.tracks_decode_prefixes and hit is not None and m > 0:
            held = f"decode holds ~{hit} of {m} tokens"
            if hit >= self.decode_hit_fraction * m:
                return Decision(False, held, "cached")
            return Decision(True, f"{held} (< {self.decode_hit_fraction:g})", "disaggregated")
        return Decision(True, f"prompt of {m} tokens", "disaggregated")


def without_prefill(needed: Decision, why: str) -> Decision:
    """The decision for a request that ``needed`` a prefill when none could take it
    (``why``: the pool's refusal, naming what it tried)."""
    return Decision(
        False, f"{why}: decode computes the prompt alone ({needed.reason})", "no_prefill"
    )


class DisaggCounts:
    """Requests served by decode alone and through prefill, since start (``/health``)."""

    def __init__(self) -> None:
        self.by_kind: dict[str, int] = {
            "short": 0,
            "cached": 0,
            "embeds": 0,
            "no_prefill": 0,
            "disaggregated": 0,
        }

    def count(self, d: Decision) -> None:
        self.by_kind[d.kind] += 1

    def summary(self, rules: DisaggRules) -> dict[str, object]:
        k = self.by_kind
        return {
            "min_prefill_tokens": rules.min_prefill_tokens,
            "decode_hit_fraction": rules.decode_hit_fraction,
            "local": k["short"] + k["cached"] + k["embeds"] + k["no_prefill"],
            "local_short": k["short"],
            "local_cached": k["cached"],
            "local_embeds": k["embeds"],
            # Needed a prefill, found none available: decode computed the prompt alone.
            "local_no_prefill": k["no_prefill"],
            "disaggregated": k["disaggregated"],
        }
