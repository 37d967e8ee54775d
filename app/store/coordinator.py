"""Cache-hit length across KV cache groups, exactly as vLLM 0.32's KV cache coordinator.

The pool holds blocks per group; a request can reuse a prefix of ``L`` tokens only when every
group can resume at ``L``. Each kind of group has its own finder (vLLM's
``SingleTypeKVCacheManager.find_longest_cache_hit``; DESIGN §9):

* full attention / MLA: the longest prefix of hits;
* sliding window ``w``: the right-most run of ``ceil((w - 1) / bs)`` hits whose end is aligned,
  or, when there is none, the run of hits starting at block 0 (shorter than the window, but
  nothing earlier is needed), aligned down;
* chunked local attention with chunk ``c``: the hits from the start of ``L``'s chunk up to
  ``L`` (blocks of earlier chunks are never read);
* Mamba-style state ("align" mode): the right-most hit whose end is aligned.

``L`` is a multiple of the lcm of the group block sizes and at most ``num_tokens - 1`` (the last
prompt token is always recomputed, for its logits). Groups with identical specs share one
lookup (a block counts only if present for all of them). With one group this is vLLM's
``UnitaryKVCacheCoordinator``: one finder call. With more it is ``HybridKVCacheCoordinator``:
finders run on the current candidate, full attention first (its prefix is cached and only cut
afterwards); any group can only shrink the candidate, so passes repeat until none shrinks (after
one pass when the only groups are full attention and one other spec).

EAGLE/MTP, as vLLM: the EAGLE groups are the ones named (all groups when none are). An EAGLE
spec group drops one block once per candidate length: full attention drops its last matched
block, then aligns down; sliding window needs one more block in its run, aligns the run's end
*after* the drop, and on the run from block 0 aligns, drops, and aligns again. With two or more
groups the finder looks one block past the candidate first (capped at the request's whole hash
blocks), so the drop lands back on it; a single group looks only up to ``num_tokens - 1``. A
Mamba group counts among the EAGLE groups -- it takes its one verification per candidate, so a
cut it makes does not make the other groups drop again -- but looks no block ahead and drops
nothing (the draft model has no Mamba layers). The margin, the cap and the per-candidate
bookkeeping make results that a stricter reading would not give, e.g. a sliding window verified
at a longer candidate is not dropped again after Mamba cuts the candidate.

Where vLLM refuses, so do we: EAGLE with chunked local attention, and a chunked-local group whose
block size is not the lcm. vLLM 0.32 can also land hits between block boundaries ("partial hash
hits": a Mamba group in align mode with blocks larger than the hash block); the pool stores whole
blocks, so its lengths are vLLM's with those off -- which is what vLLM does whenever every
group's block size equals the hash block size, the default for hybrid Mamba models.

Masks. ``load_masks`` say which blocks of each group to fetch for a hit of ``L`` tokens: all of
them for full attention, the window tail for sliding window, the current chunk for chunked local,
the single state block ending at ``L`` for Mamba. ``store_masks`` follow the Mooncake Store
connector's hybrid PR: after prefill a request stores what a later request would *load* when
hitting this request's whole cacheable prefix ``C = round_down(computed tokens, lcm)`` -- full
attention every full block up to ``C``, sliding window only the window tail before ``C``,
chunked local only ``C``'s chunk, Mamba only the state block ending at ``C``. Blocks past ``C``
are not stored: no hit can use them, since hits are lcm-aligned and need every group. With
EAGLE, attention groups also store the one block after ``C`` (when it is full), because a later
EAGLE lookup matches one block past the boundary before dropping it; Mamba looks no block ahead,
so it stores none. When every group has the same block size and no EAGLE, ``C`` is all full
blocks and full attention stores every one.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import reduce
from typing import Literal, get_args

from app.errors import ConfigError

GroupKind = Literal["full_attention", "sliding_window", "chunked_local", "mamba", "mla"]

_KINDS: frozenset[str] = frozenset(get_args(GroupKind))
_FULL_KINDS: frozenset[str] = frozenset({"full_attention", "mla"})

Mask = tuple[bool, ...]


def cdiv(a: int, b: int) -> int:
    """Ceiling division for non-negative ``a`` and positive ``b``."""
    return -(-a // b)


@dataclass(frozen=True)
class PoolGroup:
    """The spec of one KV cache group as far as cache hits are concerned.

    MLA behaves as full attention. A sliding window must be at least 2 tokens (a 1-token window
    reads no earlier block, a case vLLM's finder does not have), and an attention chunk a
    multiple of the block size (so no block straddles two chunks).
    """

    kind: GroupKind
    block_size: int
    sliding_window: int | None = None
    attention_chunk_size: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ConfigError(f"unknown group kind {self.kind!r}; expected one of {sorted(_KINDS)}")
        if self.block_size <= 0:
            raise ConfigError(f"block_size must be positive, got {self.block_size}")
        if self.kind == "sliding_window":
            # A window of 1 token reads no earlier block; vLLM's finder has no case for it.
            if self.sliding_window is None or self.sliding_window < 2:
                raise ConfigError("a sliding_window group needs sliding_window >= 2")
        elif self.sliding_window is not None:
            raise ConfigError(
                f"sliding_window is only meaningful for sliding_window groups, not {self.kind}"
            )
        if self.kind == "chunked_local":
            chunk = self.attention_chunk_size
            if chunk is None or chunk < 1 or chunk % self.block_size:
                # Chunks must start on block boundaries, else a block straddles two chunks.
                raise ConfigError(
                    "a chunked_local group needs attention_chunk_size, a positive multiple of "
                    f"its block size {self.block_size}; got {chunk}"
                )
        elif self.attention_chunk_size is not None:
            raise ConfigError(
                f"attention_chunk_size is only meaningful for chunked_local groups, not {self.kind}"
            )

    @property
    def is_full(self) -> bool:
        """Full attention or MLA: both read every earlier block."""
        return self.kind in _FULL_KINDS

    @property
    def window_blocks(self) -> int:
        """Blocks a sliding-window group needs before the resume point."""
        assert self.sliding_window is not None
        return cdiv(self.sliding_window - 1, self.block_size)


@dataclass(frozen=True)
class CacheHit:
    """Result of a lookup: the hit length and, per group, which blocks to load and to store."""

    hit_tokens: int
    load_masks: tuple[Mask, ...]
    store_masks: tuple[Mask, ...]
    iterations: int


@dataclass(frozen=True)
class _SpecGroup:
    spec: PoolGroup
    group_ids: tuple[int, ...]
    use_eagle: bool


def _hit(mask: Sequence[bool], i: int) -> bool:
    return i < len(mask) and mask[i]


def _align_down(n: int, bs: int, align: int) -> int:
    """Largest ``k <= n`` blocks whose length ``k * bs`` is a multiple of ``align``."""
    while n > 0 and (n * bs) % align:
        n -= 1
    return n


def _find_full(mask: Mask, bs: int, max_len: int, drop: bool, align: int) -> int:
    limit = min(max_len // bs, len(mask))
    n = 0
    while n < limit and mask[n]:
        n += 1
    if drop and n > 0:
        n -= 1
    return _align_down(n, bs, align) * bs


def _find_sliding(mask: Mask, spec: PoolGroup, max_len: int, drop: bool, align: int) -> int:
    bs = spec.block_size
    # With EAGLE one more contiguous block is needed, and dropped at the end.
    need = spec.window_blocks + (1 if drop else 0)
    shift = 1 if drop else 0
    run = 0
    for i in range(max_len // bs - 1, -1, -1):
        if _hit(mask, i):
            # A run may only end where the (post-drop) hit length is aligned.
            if run == 0 and ((i + 1 - shift) * bs) % align:
                continue
            run += 1
            if run >= need:
                return (i + run - shift) * bs
        else:
            run = 0
    # No full window anywhere: the run touching block 0 is still a hit. vLLM aligns it, then
    # drops the EAGLE block, then aligns again (so a drop can cost more than one block).
    n = _align_down(run, bs, align)
    if drop and n > 0:
        n = _align_down(n - 1, bs, align)
    return n * bs


def _find_chunked(mask: Mask, spec: PoolGroup, max_len: int) -> int:
    assert spec.attention_chunk_size is not None
    bs = spec.block_size
    chunk_start = (max_len // spec.attention_chunk_size) * spec.attention_chunk_size
    n = chunk_start // bs
    limit = max_len // bs
    while n < limit and _hit(mask, n):
        n += 1
    return n * bs


def _find_mamba(mask: Mask, bs: int, max_len: int, align: int) -> int:
    for i in range(max_len // bs - 1, -1, -1):
        if _hit(mask, i) and ((i + 1) * bs) % align == 0:
            return (i + 1) * bs
    return 0


def group_rule_holds(group: PoolGroup, mask: Sequence[bool], length: int) -> bool:
    """Whether ``group`` can resume at ``length`` tokens given which of its blocks are pooled."""
    m = tuple(bool(x) for x in mask)
    bs = group.block_size
    if length < 0 or length % bs:
        return False
    n = length // bs
    if n == 0:
        return True
    if group.is_full:
        return all(_hit(m, i) for i in range(n))
    if group.kind == "sliding_window":
        return all(_hit(m, i) for i in range(max(0, n - group.window_blocks), n))
    if group.kind == "chunked_local":
        assert group.attention_chunk_size is not None
        start = (length // group.attention_chunk_size) * group.attention_chunk_size
        return all(_hit(m, i) for i in range(start // bs, n))
    return _hit(m, n - 1)


def _needed_blocks(group: PoolGroup, length: int) -> range:
    """Blocks of ``group`` a resume at ``length`` reads (``length`` a multiple of its bs)."""
    bs = group.block_size
    n = length // bs
    if n == 0:
        return range(0)
    if group.is_full:
        return range(n)
    if group.kind == "sliding_window":
        return range(max(0, n - group.window_blocks), n)
    if group.kind == "chunked_local":
        assert group.attention_chunk_size is not None
        start = (length // group.attention_chunk_size) * group.attention_chunk_size
        return range(start // bs, n)
    return range(n - 1, n)


class PoolCoordinator:
    """Hit length and per-group load / store masks for one model's KV cache groups."""

    def __init__(
        self,
        groups: Sequence[PoolGroup],
        *,
        use_eagle: bool = False,
        eagle_group_ids: Iterable[int] | None = None,
    ) -> None:
        if not groups:
            raise ConfigError("the pool coordinator needs at least one KV cache group")
        self.groups: tuple[PoolGroup, ...] = tuple(groups)
        self.lcm_block_size: int = reduce(math.lcm, (g.block_size for g in self.groups))
        self.hash_block_size: int = reduce(math.gcd, (g.block_size for g in self.groups))
        self.use_eagle = use_eagle
        eagle_ids: frozenset[int] = frozenset()
        if use_eagle:
            # No explicit draft groups: every group is an EAGLE group, Mamba included (vLLM's
            # conservative default).
            eagle_ids = frozenset(
                range(len(self.groups)) if eagle_group_ids is None else eagle_group_ids
            )
            bad = [i for i in eagle_ids if not 0 <= i < len(self.groups)]
            if bad:
                raise ConfigError(f"eagle group ids {bad} out of range")
            chunked = [i for i in eagle_ids if self.groups[i].kind == "chunked_local"]
            if chunked:
                raise ConfigError(
                    f"EAGLE/MTP with chunked local attention (groups {chunked}) is not supported; "
                    "vLLM refuses this combination too"
                )
        odd_chunked = [
            i
            for i, g in enumerate(self.groups)
            if g.kind == "chunked_local" and g.block_size != self.lcm_block_size
        ]
        if odd_chunked:
            raise ConfigError(
                f"chunked local attention groups {odd_chunked} need the block size every group's "
                f"block size divides ({self.lcm_block_size}); vLLM supports no other"
            )
        self.eagle_group_ids: frozenset[int] = eagle_ids
        self._spec_groups = self._split_by_spec()

    def _split_by_spec(self) -> tuple[_SpecGroup, ...]:
        merged: dict[PoolGroup, list[int]] = {}
        for i, g in enumerate(self.groups):
            merged.setdefault(g, []).append(i)
        spec_groups = [
            _SpecGroup(spec, tuple(ids), any(i in self.eagle_group_ids for i in ids))
            for spec, ids in merged.items()
        ]
        # Full attention first: its left-to-right prefix is the tightest first bound.
        spec_groups.sort(key=lambda sg: not sg.spec.is_full)
        return tuple(spec_groups)

    @property
    def takes_tails(self) -> bool:
        """Whether a hit may end inside a block (a *tail*, ``hashing.tail_hash``): only where
        every group is full attention or MLA of one block size, without EAGLE. vLLM then
        resumes at any token and every group reads the whole prefix; a sliding window, a chunk
        or a Mamba state is only ever hit at a block boundary."""
        return (
            all(g.is_full for g in self.groups)
            and len({g.block_size for g in self.groups}) == 1
            and not self.eagle_group_ids
        )

    @property
    def spec_group_ids(self) -> tuple[tuple[int, ...], ...]:
        """Group ids per merged lookup, in evaluation order."""
        return tuple(sg.group_ids for sg in self._spec_groups)

    def _merged_mask(self, masks: Sequence[Mask], group_ids: tuple[int, ...]) -> Mask:
        length = min(len(masks[i]) for i in group_ids)
        return tuple(all(masks[i][j] for i in group_ids) for j in range(length))

    def _find(self, sg: _SpecGroup, mask: Mask, max_len: int, drop: bool) -> int:
        spec, align = sg.spec, self.lcm_block_size
        if spec.is_full:
            return _find_full(mask, spec.block_size, max_len, drop, align)
        if spec.kind == "sliding_window":
            return _find_sliding(mask, spec, max_len, drop, align)
        if spec.kind == "chunked_local":
            # Its block size is the lcm (checked at construction), so no alignment is needed.
            return _find_chunked(mask, spec, max_len)
        # Mamba's finder takes no EAGLE drop: the draft model has no Mamba layers.
        return _find_mamba(mask, spec.block_size, max_len, align)

    def find_longest_cache_hit(
        self, hit_masks: Sequence[Sequence[bool]], num_tokens: int
    ) -> CacheHit:
        """Longest reusable prefix given, per group, which of its block hashes the pool holds.

        ``hit_masks[g][i]`` is whether block ``i`` (of group ``g``'s block size) is pooled;
        missing entries count as misses.
        """
        if len(hit_masks) != len(self.groups):
            raise ValueError(f"expected {len(self.groups)} hit masks, got {len(hit_masks)}")
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be non-negative, got {num_tokens}")
        masks = tuple(tuple(bool(x) for x in m) for m in hit_masks)
        max_len = max(0, num_tokens - 1)
        merged = [self._merged_mask(masks, sg.group_ids) for sg in self._spec_groups]
        if len(self.groups) == 1:
            # vLLM's unitary coordinator: one lookup up to num_tokens - 1, no look-ahead.
            (sg,) = self._spec_groups
            hit = self._find(sg, merged[0], max_len, sg.use_eagle)
            return self._result(hit, num_tokens, 1)
        # The look-ahead may reach past num_tokens - 1, up to the request's last whole hash block.
        lookahead_cap = (num_tokens // self.hash_block_size) * self.hash_block_size
        full_hit: dict[int, int] = {}
        simple_hybrid = len(self._spec_groups) == 2 and self._spec_groups[0].spec.is_full
        eagle_verified: set[int] = set()
        hit_length = max_len
        iterations = 0
        while True:
            iterations += 1
            curr = hit_length
            for idx, sg in enumerate(self._spec_groups):
                if sg.spec.is_full and idx in full_hit:
                    # A full-attention prefix stays valid when cut shorter: no second lookup.
                    curr = min(curr, full_hit[idx])
                    continue
                drop = sg.use_eagle and idx not in eagle_verified
                limit = curr
                if drop and sg.spec.kind != "mamba":
                    # Match one block past the candidate, then drop it: lands back on curr.
                    limit = min(curr + sg.spec.block_size, lookahead_cap)
                got = self._find(sg, merged[idx], limit, drop)
                if drop:
                    # Verified at this candidate, Mamba too: its cut clears nothing.
                    eagle_verified.add(idx)
                elif got < curr:
                    # The candidate moved: earlier EAGLE drops must be applied again there.
                    eagle_verified.clear()
                curr = got
                if sg.spec.is_full:
                    full_hit[idx] = got
            if curr >= hit_length:
                break
            hit_length = curr
            if simple_hybrid:
                # Full attention then one other kind: the second finder's answer is final.
                break
        return self._result(hit_length, num_tokens, iterations)

    def _result(self, hit_tokens: int, num_tokens: int, iterations: int) -> CacheHit:
        return CacheHit(
            hit_tokens=hit_tokens,
            load_masks=self.load_masks(hit_tokens),
            store_masks=self.store_masks(num_tokens),
            iterations=iterations,
        )

    def load_masks(self, hit_tokens: int, held_tokens: int = 0) -> tuple[Mask, ...]:
        """Per group, which of the blocks before ``hit_tokens`` to load from the pool: the ones
        a resume at ``hit_tokens`` reads, less those the engine's own cache hit of
        ``held_tokens`` already put in place (its blocks are shared and read-only)."""
        if hit_tokens % self.lcm_block_size:
            raise ValueError(f"hit {hit_tokens} is not a multiple of {self.lcm_block_size}")
        out: list[Mask] = []
        for g in self.groups:
            needed = _needed_blocks(g, hit_tokens)
            first = max(0, held_tokens) // g.block_size
            out.append(tuple(i in needed and i >= first for i in range(hit_tokens // g.block_size)))
        return tuple(out)

    def cacheable_tokens(self, num_computed_tokens: int) -> int:
        """Longest prefix a later hit could reuse: computed tokens aligned down to the lcm."""
        return (max(0, num_computed_tokens) // self.lcm_block_size) * self.lcm_block_size

    def store_masks(
        self, num_computed_tokens: int, held: Sequence[Sequence[bool]] | None = None
    ) -> tuple[Mask, ...]:
        """Per group, which full blocks of ``num_computed_tokens`` to store after prefill.

        ``held`` says, per group, which blocks the request still holds: vLLM hands a sliding
        window's blocks behind the window back (the null block takes their place) while a
        request runs, so after a long prompt or generated tokens the tail a hit at the whole
        prefix needs may be gone. The stored prefix is then the longest one whose every needed
        block is held, or none: a page read from the null block is not the prefix's KV.
        """
        cacheable = self.storable_tokens(num_computed_tokens, held)
        out: list[Mask] = []
        for gid, g in enumerate(self.groups):
            num_full = max(0, num_computed_tokens) // g.block_size
            chosen = set(_needed_blocks(g, cacheable))
            lookahead = cacheable // g.block_size
            # Mamba's lookup takes no look-ahead block, so it needs none stored.
            if (
                gid in self.eagle_group_ids
                and g.kind != "mamba"
                and lookahead < num_full
                and (held is None or _hit(held[gid], lookahead))
            ):
                chosen.add(lookahead)
            out.append(tuple(i in chosen for i in range(num_full)))
        return tuple(out)

    def storable_tokens(
        self, num_computed_tokens: int, held: Sequence[Sequence[bool]] | None = None
    ) -> int:
        """The longest cacheable prefix whose every needed block is ``held`` (all of it
        without ``held``)."""
        cacheable = self.cacheable_tokens(num_computed_tokens)
        while held is not None and cacheable > 0 and not self._holds(held, cacheable):
            cacheable -= self.lcm_block_size
        return cacheable

    def _holds(self, held: Sequence[Sequence[bool]], length: int) -> bool:
        """Every block a resume at ``length`` reads is held, in every group."""
        return all(
            all(_hit(held[gid], i) for i in _needed_blocks(g, length))
            for gid, g in enumerate(self.groups)
        )


def find_longest_cache_hit(
    groups: Sequence[PoolGroup],
    hit_masks: Sequence[Sequence[bool]],
    num_tokens: int,
    *,
    use_eagle: bool = False,
) -> CacheHit:
    """One-shot form of :meth:`PoolCoordinator.find_longest_cache_hit`."""
    return PoolCoordinator(groups, use_eagle=use_eagle).find_longest_cache_hit(
        hit_masks, num_tokens
    )
