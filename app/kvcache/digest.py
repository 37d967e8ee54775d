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
import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

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
        for base, size in self.spans:
            if base <= addr and addr + length <= base + size:
                buf = (ctypes.c_uint8 * length).from_address(addr)
                return np.frombuffer(memoryview(buf).cast("B"), np.uint8)
        raise OutOfBoundsError(
            f"digest of 0x{addr:x}+{length}: outside the {len(self.spans)} mapped KV spans"
        )


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
    incident). One holder serves the push and the pool; each decision reads ``value`` once."""

    def __init__(self, value: float) -> None:
        self.value = 0.0
        self.set(value)

    def set(self, value: float) -> None:
        if not 0.0 <= value <= 1.0:
            raise ConfigError(f"kv_digest.share is a share of requests in [0, 1], got {value!r}")
        self.value = float(value)


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
