"""A KV digest over exactly the bytes a plan moves (issue 51), numpy over the mapped memory.

Each descriptor ``(address, length)`` gets two 64-bit words: the wrapped sum of its 64-bit
lanes and the wrapped sum of each lane times its index + 1 (a tail shorter than a lane is
zero-padded into one more lane). Prefill computes them over a plan's source descriptors, decode
over the same plan's destination descriptors, in the same order with the same lengths, so the
two agree exactly when the bytes do. Any change confined to one lane changes the plain sum
(the difference is a nonzero residue mod 2**64), so a flipped byte is always caught; the
weighted sum catches lanes swapped or moved inside a run.
"""

from __future__ import annotations

import ctypes
import hashlib
import random
import threading
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

import msgspec
import numpy as np

from app.errors import ConfigError, OutOfBoundsError

_LANE = 8
# Lane weights reused across calls (1, 2, 3, ...): grown on demand, never per call.
_weights = np.arange(1, 1 + (1 << 16), dtype=np.uint64)


def _lane_weights(n: int) -> np.ndarray:
    global _weights
    if n > _weights.size:
        _weights = np.arange(1, 1 + max(n, 2 * _weights.size), dtype=np.uint64)
    return _weights[:n]


class DigestRuns(msgspec.Struct, frozen=True, array_like=True):
    """What one prefill rank wrote to one decode rank, run by run, with each run's digest (in
    ``Done``): little-endian int64 ``layer``, ``group``, decode address and length per run, and
    two uint64 words per run. Decode digests its own bytes at those addresses, inside its own
    registered memory only."""

    layer: bytes
    group: bytes
    dst: bytes
    length: bytes
    sums: bytes

    @classmethod
    def of(
        cls,
        layer: np.ndarray,
        group: np.ndarray,
        dst: np.ndarray,
        length: np.ndarray,
        sums: np.ndarray,
    ) -> DigestRuns:
        def b(a: np.ndarray, dt: str) -> bytes:
            return np.ascontiguousarray(a, dt).tobytes()

        return cls(
            b(layer, "<i8"), b(group, "<i8"), b(dst, "<i8"), b(length, "<i8"), b(sums, "<u8")
        )

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The five arrays, or ValueError when their sizes disagree (a malformed Done)."""
        out = [np.frombuffer(getattr(self, f), "<i8") for f in ("layer", "group", "dst", "length")]
        sums = np.frombuffer(self.sums, "<u8").astype(np.uint64)
        n = out[0].size
        if any(a.size != n for a in out) or sums.size != 2 * n or (out[3] < 0).any():
            raise ValueError(
                f"digest runs of inconsistent sizes: {[a.size for a in out]}, {sums.size} sums"
            )
        return out[0], out[1], out[2], out[3], sums.reshape(n, 2)


DigestState = Literal["off", "sent", "ok", "mismatch", "refused"]
"""A request's digest as its record shows it (``Request.digest``, the admin API)."""


@dataclass(frozen=True)
class DigestMismatch:
    """Where a digest first differed: the run of ``layer`` in ``group`` (of ``kind``) at
    ``block``, as the admin API's record and the log name it. ``sender_rank``: the prefill
    rank that wrote it (-1: the pool)."""

    sender_rank: int
    layer: int
    group: int
    kind: str
    block: int
    nbytes: int


@dataclass(frozen=True)
class DigestVerdict:
    """One check: ``why`` empty when the bytes matched (or were not read: ``checked`` False),
    else the reason the request failed; ``mismatch`` when bytes differed (None when a run was
    refused unread)."""

    why: str = ""
    checked: bool = False
    mismatch: DigestMismatch | None = None


@dataclass
class DigestStats:
    """Digests computed (runs and bytes, per side: prefill, decode, pool) and mismatches by
    (group kind, side)."""

    runs: Counter[str] = field(default_factory=Counter)
    bytes: Counter[str] = field(default_factory=Counter)
    mismatches: Counter[tuple[str, str]] = field(default_factory=Counter)
    # Digests run on worker threads, several at once.
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, side: str, runs: int, nbytes: int) -> None:
        with self.lock:
            self.runs[side] += runs
            self.bytes[side] += nbytes


@dataclass(frozen=True)
class HostMemory:
    """Spans ``(address, size)`` of this process's mappings of an engine's KV (CPU: the shared
    memory the sidecar mapped), read as numpy without a copy; an address outside them is an
    error, never a read."""

    spans: tuple[tuple[int, int], ...]

    def read(self, addr: int, length: int) -> np.ndarray:
        locate(self.spans, addr, length)
        buf = (ctypes.c_uint8 * length).from_address(addr)
        return np.frombuffer(memoryview(buf).cast("B"), np.uint8)

    def digest(self, addrs: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """``digest_runs`` over this memory."""
        return digest_runs(self, addrs, lengths)


def locate(spans: Sequence[tuple[int, int]], addr: int, length: int) -> tuple[int, int]:
    """The span ``(address, size)`` holding ``length`` bytes at ``addr``: its index and the
    offset in it; OutOfBoundsError when none does (the digest never reads outside them)."""
    for i, (base, size) in enumerate(spans):
        if base <= addr and addr + length <= base + size:
            return i, addr - base
    raise OutOfBoundsError(
        f"digest of 0x{addr:x}+{length}: outside the {len(spans)} mapped KV spans"
    )


class KvMemory(Protocol):
    """An engine's KV as this process can digest it: ``HostMemory`` (numpy over the mapped
    pages) or ``tensor_digest.TensorMemory`` (torch ops on the device)."""

    def digest(self, addrs: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """Two uint64 words per run ``(addrs[i], lengths[i])``, shape ``(n, 2)``."""
        ...


def digest_runs(memory: HostMemory, addrs: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Two 64-bit words per descriptor (shape ``(n, 2)``, uint64): wrapped lane sum and wrapped
    index-weighted lane sum over ``length`` bytes at ``addr``."""
    out = np.zeros((int(addrs.size), 2), np.uint64)
    for i, (addr, length) in enumerate(zip(addrs.tolist(), lengths.tolist(), strict=True)):
        data = memory.read(int(addr), int(length))
        full = length - length % _LANE
        lanes = data[:full].view(np.uint64)
        if full != length:
            tail = np.zeros(_LANE, np.uint8)
            tail[: length - full] = data[full:]
            lanes = np.concatenate([lanes, tail.view(np.uint64)])
        with np.errstate(over="ignore"):
            out[i, 0] = lanes.sum(dtype=np.uint64)
            out[i, 1] = np.dot(lanes, _lane_weights(lanes.size))
    return out


class DigestShare:
    """``kv_digest.share`` as a running sidecar reads it: from the settings at start, changed
    by the admin API (``PUT /v1/kv_digest``) without a restart (e.g. 1.0 while hunting an
    incident). One holder serves the push and the pool; each decision reads ``value`` once.

    The push draws with ``draw``: over any run of n requests it picks n x share of them give or
    take 2, at random places. A hash of the id (``sampled``, which the pool needs) picks a
    binomial count instead: 5 of 12 at 1/8 in one bench run, four times the expected cost."""

    _REMEMBERED = 4096  # ids whose draw is kept: every rank of a request sees the same one

    def __init__(self, value: float, rng: random.Random | None = None) -> None:
        self.value = 0.0
        self.set(value)
        self._rng = rng or random.Random()
        # Each request adds ``value`` to the credit; one whose credit reaches the threshold is
        # drawn and pays 1; the threshold is redrawn in (0, 1] each time, so the picks keep
        # the rate exactly and never fall into a fixed period a workload could alias with.
        self._credit = 0.0
        self._threshold = self._next_threshold()
        self._drawn: OrderedDict[str, bool] = OrderedDict()

    def set(self, value: float) -> None:
        if not 0.0 <= value <= 1.0:
            raise ConfigError(f"kv_digest.share is a share of requests in [0, 1], got {value!r}")
        self.value = float(value)

    def _next_threshold(self) -> float:
        return 1.0 - self._rng.random()

    def draw(self, request_id: str) -> bool:
        """Whether the push of ``request_id`` is digested; asked again (another rank of the
        same request), the same answer."""
        known = self._drawn.get(request_id)
        if known is not None:
            return known
        share = self.value
        if share <= 0.0 or share >= 1.0:
            pick = share >= 1.0
        else:
            self._credit += share
            pick = self._credit >= self._threshold
            if pick:
                self._credit -= 1.0
                self._threshold = self._next_threshold()
        self._drawn[request_id] = pick
        if len(self._drawn) > self._REMEMBERED:
            self._drawn.popitem(last=False)
        return pick


def sampled(transfer_id: str, share: float) -> bool:
    """Whether ``transfer_id``'s KV is digested at ``share`` (0: never, 1: always): a hash of the
    id, so the choice is the same wherever it is made, and a retry under a new id is drawn anew."""
    if share <= 0.0:
        return False
    if share >= 1.0:
        return True
    h = int.from_bytes(hashlib.blake2b(transfer_id.encode(), digest_size=8).digest(), "little")
    return h < share * 2.0**64


def first_mismatch(got: np.ndarray, want: Sequence[Sequence[int]] | np.ndarray) -> int | None:
    """The index of the first descriptor whose digest differs, or None."""
    expected = np.asarray(want, np.uint64).reshape(-1, 2)
    if expected.shape != got.shape:
        return 0
    bad = np.flatnonzero((got != expected).any(axis=1))
    return int(bad[0]) if bad.size else None
