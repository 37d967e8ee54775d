"""The prefix an engine will really reuse for a prompt, from its per-group index answers.

The index (index.py) says, per KV cache group, which whole blocks of a prompt the engine holds.
vLLM does not reuse "the leading blocks of group 0": its coordinator accepts a hit of ``L`` tokens
only when every group can resume at ``L`` (a sliding window needs its tail blocks, Mamba the state
block ending at ``L``). Those rules live in app/store/coordinator.py; this module only maps the
index's groups onto its ``PoolGroup`` specs and asks it.

Kinds (vLLM's ``KVCacheSpecKind`` values, as ``BlockStored`` carries them) map to the kind of the
manager vLLM registers for them: ``full_attention`` and ``sink_full_attention`` are full
attention, ``mla_attention`` is MLA, ``sliding_window`` and ``sliding_window_mla`` are sliding
windows, ``mamba`` is Mamba state (align mode, the only one with prefix caching). Any other kind
(``chunked_local_attention``: its chunk size is not in the events; encoder/cross attention;
``unknown``; no kind published) is answered conservatively: a hit of 0, the group named as the
limit and the reason given -- the router would rather under-count than send a request where the
engine recomputes it all.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from app.errors import ConfigError
from app.proxy.kv_events.index import GroupHit, GroupId
from app.store.coordinator import GroupKind, PoolCoordinator, PoolGroup, group_rule_holds

# vLLM's spec kind -> the coordinator kind whose finder vLLM runs for it.
_KINDS: dict[str, GroupKind] = {
    "full_attention": "full_attention",
    "sink_full_attention": "full_attention",
    "mla_attention": "mla",
    "sliding_window": "sliding_window",
    "sliding_window_mla": "sliding_window",
    "mamba": "mamba",
}


@dataclass(frozen=True)
class EngineHit:
    """What an engine will reuse of a prompt.

    ``tokens``: the cache hit vLLM's coordinator accepts. ``groups``: per group, the hit it alone
    would allow (as if it were the engine's only group). ``limited_by``: the first group that
    cannot resume one lcm step further (None: the prompt itself ends the hit, nothing is
    held, or an EAGLE drop alone shortened it). ``unsupported``: why the answer was forced to
    0, if it was.
    """

    tokens: int
    groups: tuple[tuple[GroupId, int], ...]
    limited_by: GroupId | None
    unsupported: str | None = None


def coordinator_kind(spec_kind: str | None) -> GroupKind | None:
    """The coordinator kind vLLM scores a spec kind as (None: one it has no rule for here)."""
    return _KINDS.get(spec_kind or "")


def pool_group(hit: GroupHit) -> PoolGroup:
    """The coordinator's spec for one index group; ConfigError for kinds it cannot score."""
    kind = coordinator_kind(hit.kind)
    if kind is None:
        raise ConfigError(
            f"group {hit.group.group} ({hit.group.medium}) has KV cache spec kind {hit.kind!r}, "
            f"which has no cache-hit rule here; known: {sorted(_KINDS)}"
        )
    window = hit.sliding_window if kind == "sliding_window" else None
    return PoolGroup(kind, hit.block_size, sliding_window=window)


def engine_hit(
    hits: Sequence[GroupHit],
    num_tokens: int,
    *,
    num_groups: int | None = None,
    use_eagle: bool = False,
) -> EngineHit:
    """The cache hit, in tokens, vLLM accepts for a ``num_tokens`` prompt given one medium's
    per-group index answers (``InstanceIndex.lookup``).

    A group the index never saw store anything holds nothing, so it forces a hit of 0: groups
    are expected to be ``0..num_groups - 1`` (default: up to the highest one seen). Unknown
    kinds force 0 too (see the module docstring). ``use_eagle``: the engine runs EAGLE/MTP.
    Raises ValueError for hits of several media or a group given twice.
    """
    media = {h.group.medium for h in hits}
    if len(media) > 1:
        raise ValueError(f"expected one medium's groups; got {sorted(map(str, media))}")
    seen = [h.group.group for h in hits]
    if len(set(seen)) != len(seen):
        raise ValueError(f"expected each group once; got groups {seen}")
    if not hits:
        return EngineHit(0, (), None)
    medium = next(iter(media))
    by_index = {h.group.group: h for h in hits}
    count = num_groups if num_groups is not None else max(seen) + 1
    missing = [g for g in range(count) if g not in by_index]
    if missing:
        # Vacant groups hold no block of anything: no kind can resume past 0 then.
        gid = GroupId(missing[0], medium)
        why = f"group {missing[0]} ({medium}) published no stores: it holds nothing"
        return _zero(hits, gid, why)
    ordered = [by_index[g] for g in sorted(by_index)]
    specs: list[PoolGroup] = []
    for h in ordered:
        try:
            specs.append(pool_group(h))
        except ConfigError as e:
            return _zero(hits, h.group, str(e))
    masks = [h.held for h in ordered]
    coordinator = PoolCoordinator(specs, use_eagle=use_eagle)
    tokens = coordinator.find_longest_cache_hit(masks, num_tokens).hit_tokens
    solo = tuple(
        (
            h.group,
            PoolCoordinator([s], use_eagle=use_eagle)
            .find_longest_cache_hit([h.held], num_tokens)
            .hit_tokens,
        )
        for h, s in zip(ordered, specs, strict=True)
    )
    return EngineHit(tokens, solo, _limit(ordered, specs, tokens, num_tokens, coordinator))


def _limit(
    hits: Sequence[GroupHit],
    specs: Sequence[PoolGroup],
    tokens: int,
    num_tokens: int,
    coordinator: PoolCoordinator,
) -> GroupId | None:
    """The first group whose rule fails one lcm step past the hit (None: past the prompt)."""
    nxt = tokens + coordinator.lcm_block_size
    if nxt > num_tokens - 1:
        return None  # the last prompt token is always recomputed: the prompt ends it
    for h, s in zip(hits, specs, strict=True):
        if not group_rule_holds(s, h.held, nxt):
            return h.group
    return None


def _zero(hits: Sequence[GroupHit], limit: GroupId, why: str) -> EngineHit:
    return EngineHit(0, tuple((h.group, 0) for h in hits), limit, why)
