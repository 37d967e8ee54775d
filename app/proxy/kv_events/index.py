"""What one engine really holds, per KV cache group, from its own KV cache events.

Per instance an ``InstanceIndex`` follows vLLM's event batches in sequence order and keeps, per
group (vLLM's ``group_idx``, per storage ``medium``), the block hashes the engine holds and the
router's key (keys.py) of the token prefix each stands for. A lookup turns a prompt into keys
once and answers, per group, how many of its leading whole blocks the engine holds.

**Consistent** means the index saw every batch since a state it knew whole: an engine's first
batch (seq 0: a fresh engine holds nothing), ``AllBlocksCleared``, or a replay of an engine that
published nothing yet. Anything else loses that, with the first reason kept until it comes
back: a sequence gap, a seq that went back (a restarted engine), a batch that did not decode,
a block chained from a parent the index does not hold, the ``max_blocks`` bound. Losing it
clears the index (a missed ``BlockRemoved`` could otherwise leave a block it no longer holds),
so from there the answers are a lower bound: every block the index names was stored after the
clear and its removal would have been seen.

Blocks are held as a set per group: vLLM may cache two physical copies of one hash, and the
first removal drops it here (an under-count); a request's ``kv_cache_report_mode: full`` repeats
stores of blocks already held, which a set absorbs. A ``BlockStored`` whose token run is longer
than its blocks (a sliding-window group skips the blocks it will not need) cannot say which
tokens a block covers; such blocks are placed from another group that holds the same hash (vLLM
hashes a prefix the same in every group), else counted as unplaced and left out.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from enum import Enum

from app.proxy.kv_events.keys import KeyScheme, PromptKeys, split_extra_keys
from app.proxy.kv_events.wire import (
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)

log = logging.getLogger(__name__)

DEFAULT_MAX_BLOCKS = 1_000_000
# More adapters than vLLM serves at once by far (--max-loras); past it names are not learnt.
MAX_LORA_NAMES = 4096


class Order(Enum):
    """Where a batch falls in the sequence the index followed."""

    NEXT = "next"  # apply it
    DUPLICATE = "duplicate"  # already applied (a replayed batch seen again live): skip it
    MISSING = "missing"  # batches before it were missed, or the engine restarted: resync first


@dataclass(frozen=True)
class GroupId:
    """One KV cache group of one storage medium (vLLM's ``group_idx`` and ``medium``)."""

    group: int
    medium: str | None


@dataclass(frozen=True)
class GroupHit:
    """How much of a prompt one group holds."""

    group: GroupId
    kind: str | None  # vLLM's kv_cache_spec_kind, as its last BlockStored said
    sliding_window: int | None
    block_size: int
    blocks: int  # leading whole blocks of the prompt held
    held: tuple[bool, ...]  # per whole block of the prompt: held or not

    @property
    def tokens(self) -> int:
        return self.blocks * self.block_size


@dataclass(frozen=True)
class GroupStatus:
    group: GroupId
    kind: str | None
    sliding_window: int | None
    block_size: int  # the largest seen in its BlockStored events (0: none yet)
    blocks: int


@dataclass(frozen=True)
class IndexStatus:
    """What ``/health`` can show of one instance's index."""

    consistent: bool
    reason: str | None  # why not consistent (the first cause since it last was)
    blocks: int
    max_blocks: int
    groups: tuple[GroupStatus, ...]
    last_seq: int | None
    batches: int  # applied
    unplaced: int  # stored blocks it could not key (left out of answers)
    unknown_removed: int  # removals of hashes it did not hold (e.g. after a clear)


@dataclass
class _Group:
    kind: str | None = None
    sliding_window: int | None = None
    block_size: int = 0
    held: dict[BlockHash, int] = field(default_factory=dict)  # vLLM hash -> prefix key
    keys: dict[int, int] = field(default_factory=dict)  # prefix key -> held hashes with it


class InstanceIndex:
    """One engine's prefix cache as its events tell it, group by group."""

    def __init__(
        self, scheme: KeyScheme, max_blocks: int = DEFAULT_MAX_BLOCKS, name: str = ""
    ) -> None:
        if max_blocks <= 0:
            raise ValueError(f"expected max_blocks >= 1; got {max_blocks}")
        self.name = name  # the instance, for logs
        self.scheme = scheme
        self.max_blocks = max_blocks
        self._groups: dict[GroupId, _Group] = {}
        self._blocks = 0
        self.consistent = False
        self.reason: str | None = "no events yet"
        self._fresh = True  # nothing seen yet: the first cause replaces "no events yet"
        self.last_seq: int | None = None
        self.last_ts: float | None = None
        self.batches = 0
        self.unplaced = 0
        self.unknown_removed = 0
        # Adapters the engine stored blocks under: a request naming one as its model is
        # keyed under it (a base model's name never appears in events).
        self.lora_names: set[str] = set()

    # -- sequence ------------------------------------------------------------------------

    def order(self, seq: int, ts: float) -> Order:
        """Where batch ``seq`` (published at ``ts``) falls.

        A seq at or below the last one applied is a duplicate when it is no newer than that
        one (a replayed batch seen again); newer, it comes from a restarted engine."""
        last = self.last_seq
        if last is not None and seq <= last and self.last_ts is not None and ts <= self.last_ts:
            return Order.DUPLICATE
        if seq == 0 or (last is not None and seq == last + 1):
            return Order.NEXT
        return Order.MISSING

    def apply(self, seq: int, batch: KVEventBatch) -> None:
        """Apply batch ``seq`` (not a duplicate: ``order`` says); one out of order clears the
        index first and marks it inconsistent."""
        self._follow(seq, batch.ts)
        for event in batch.events:
            if isinstance(event, BlockStored):
                self._stored(event)
            elif isinstance(event, BlockRemoved):
                self._removed(event)
            elif isinstance(event, AllBlocksCleared):
                self._clear()
                self._mark_consistent()
        self.batches += 1

    def skip(self, seq: int, ts: float | None, why: str) -> None:
        """Batch ``seq`` exists but cannot be applied (it did not decode): lose it.
        ``ts``: its time if that much could be read."""
        self._follow(seq, self.last_ts if ts is None else ts)
        self.lose(f"batch {seq} could not be applied: {why}")

    def _follow(self, seq: int, ts: float | None) -> None:
        last = self.last_seq
        if seq == 0:  # a publisher's first batch: its engine started empty
            self._clear()
            self._mark_consistent()
        elif last is None:
            self.lose(f"first batch seen is seq {seq}: batches 0..{seq - 1} were missed")
        elif seq > last + 1:
            self.lose(f"missed batches {last + 1}..{seq - 1}")
        elif seq <= last:
            self.lose(f"seq went back from {last} to {seq}: the engine restarted")
        self.last_seq, self.last_ts = seq, ts

    # -- state ---------------------------------------------------------------------------

    def lose(self, reason: str) -> None:
        """Forget everything and say why the answers are a lower bound from here."""
        self._clear()
        self._mark_inconsistent(reason)

    def restart(self, reason: str) -> None:
        """A different engine (or publisher) than the one followed: forget it, sequence too."""
        self.lose(reason)
        self.last_seq = self.last_ts = None

    def known_empty(self) -> None:
        """The engine said it published nothing yet (an empty replay from seq 0)."""
        self._clear()
        self.last_seq = self.last_ts = None
        self._mark_consistent()

    def _mark_inconsistent(self, reason: str) -> None:
        if self.consistent or self._fresh:
            log.warning("%s: KV event index inconsistent: %s", self.name, reason)
            self.consistent, self.reason, self._fresh = False, reason, False

    def _mark_consistent(self) -> None:
        if not self.consistent and not self._fresh:
            log.info("%s: KV event index consistent again (was: %s)", self.name, self.reason)
        self.consistent, self.reason, self._fresh = True, None, False

    def _clear(self) -> None:
        for g in self._groups.values():
            g.held.clear()
            g.keys.clear()
        self._blocks = 0

    # -- events --------------------------------------------------------------------------

    def _key_of(self, block_hash: BlockHash, first: _Group) -> int | None:
        """The prefix key of a hash, from its own group first, else from any group."""
        key = first.held.get(block_hash)
        if key is not None:
            return key
        for g in self._groups.values():
            key = g.held.get(block_hash)
            if key is not None:
                return key
        return None

    def _stored(self, ev: BlockStored) -> None:
        gid = GroupId(ev.group_idx or 0, ev.medium)
        n, size, unit = len(ev.block_hashes), ev.block_size, self.scheme.unit
        if size <= 0 or size % unit:
            self.unplaced += n
            self._mark_inconsistent(
                f"group {gid.group} ({gid.medium}) published block_size {size}, not a multiple "
                f"of the index's key unit of {unit} tokens: set the unit to the engine's hash "
                f"block size"
            )
            return
        g = self._groups.setdefault(gid, _Group())
        g.block_size = max(g.block_size, size)
        if ev.lora_name is not None and len(self.lora_names) < MAX_LORA_NAMES:
            self.lora_names.add(ev.lora_name)
        if ev.kv_cache_spec_kind is not None:
            g.kind, g.sliding_window = ev.kv_cache_spec_kind, ev.kv_cache_spec_sliding_window
        extras = ev.extra_keys or []
        if ev.parent_block_hash is None:
            salt, _ = split_extra_keys(extras[0] if extras else None, ev.lora_name)
            key: int | None = self.scheme.root(ev.lora_name, salt)
        else:
            key = self._key_of(ev.parent_block_hash, g)
        if key is None:
            self.unplaced += n
            self._mark_inconsistent(
                f"a BlockStored of group {gid.group} ({gid.medium}) chains from block "
                f"{ev.parent_block_hash!r}, which the index does not hold: events were missed"
            )
            return
        if len(ev.token_ids) != n * size:
            # Skipped blocks in the run: only hashes another group keyed can be placed.
            for h in ev.block_hashes:
                known = self._key_of(h, g)
                if known is None:
                    self.unplaced += 1
                else:
                    self._hold(g, h, known)
            return
        for i, h in enumerate(ev.block_hashes):
            _, opaque = split_extra_keys(extras[i] if i < len(extras) else None, ev.lora_name)
            key = self.scheme.extend(key, ev.token_ids[i * size : (i + 1) * size], opaque)[-1]
            self._hold(g, h, key)

    def _hold(self, g: _Group, block_hash: BlockHash, key: int) -> None:
        old = g.held.get(block_hash)
        if old == key:
            return  # a second copy, or a reuse report: a set holds it once
        if old is None:
            if self._blocks >= self.max_blocks:
                self.unplaced += 1
                self._mark_inconsistent(
                    f"over its bound of {self.max_blocks} blocks: stores past it are dropped"
                )
                return
            self._blocks += 1
        else:
            self._unkey(g, old)
        g.held[block_hash] = key
        g.keys[key] = g.keys.get(key, 0) + 1

    def _unkey(self, g: _Group, key: int) -> None:
        left = g.keys[key] - 1
        if left:
            g.keys[key] = left
        else:
            del g.keys[key]

    def _removed(self, ev: BlockRemoved) -> None:
        g = self._groups.get(GroupId(ev.group_idx or 0, ev.medium))
        for h in ev.block_hashes:
            key = None if g is None else g.held.pop(h, None)
            if key is None or g is None:
                self.unknown_removed += 1
                continue
            self._blocks -= 1
            self._unkey(g, key)

    # -- answers -------------------------------------------------------------------------

    def lookup(self, prompt: PromptKeys) -> tuple[GroupHit, ...]:
        """Per group that stored anything, how many of the prompt's leading whole blocks it
        holds (sorted by group, then medium)."""
        if prompt.scheme != self.scheme:
            raise ValueError("expected prompt keys made with this index's key scheme")
        hits = []
        for gid, g in sorted(self._groups.items(), key=lambda kv: _order_key(kv[0])):
            if not g.block_size:
                continue
            step = g.block_size // self.scheme.unit
            held = tuple(
                prompt.keys[j - 1] in g.keys for j in range(step, len(prompt.keys) + 1, step)
            )
            blocks = held.index(False) if False in held else len(held)
            hits.append(GroupHit(gid, g.kind, g.sliding_window, g.block_size, blocks, held))
        return tuple(hits)

    def __len__(self) -> int:
        return self._blocks

    def status(self) -> IndexStatus:
        groups = tuple(
            GroupStatus(gid, g.kind, g.sliding_window, g.block_size, len(g.held))
            for gid, g in sorted(self._groups.items(), key=lambda kv: _order_key(kv[0]))
        )
        return IndexStatus(
            consistent=self.consistent,
            reason=self.reason,
            blocks=self._blocks,
            max_blocks=self.max_blocks,
            groups=groups,
            last_seq=self.last_seq,
            batches=self.batches,
            unplaced=self.unplaced,
            unknown_removed=self.unknown_removed,
        )


def _order_key(gid: GroupId) -> tuple[int, str]:
    return gid.group, gid.medium or ""
