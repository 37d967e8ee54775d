"""The KV digest (issue 51): equal over equal bytes wherever they live, different when one byte
differs, and no read outside the mapped spans."""

from __future__ import annotations

import numpy as np
import pytest

from app.errors import OutOfBoundsError
from app.kvcache.digest import HostMemory, digest_runs, first_mismatch, sampled


def _memory(buf: np.ndarray) -> HostMemory:
    return HostMemory(((buf.ctypes.data, buf.nbytes),))


def test_same_bytes_at_other_addresses_digest_the_same() -> None:
    rng = np.random.default_rng(0)
    src = rng.integers(0, 256, 4096, dtype=np.uint8)
    dst = np.zeros(8192, np.uint8)
    # Runs of odd lengths and offsets: unaligned lanes and zero-padded tails.
    runs = [(3, 1000, 101), (1200, 61, 4000), (2000, 2000, 5007)]
    for s, n, d in runs:
        dst[d : d + n] = src[s : s + n]
    a = digest_runs(
        _memory(src),
        np.array([src.ctypes.data + s for s, _, _ in runs]),
        np.array([n for _, n, _ in runs]),
    )
    b = digest_runs(
        _memory(dst),
        np.array([dst.ctypes.data + d for _, _, d in runs]),
        np.array([n for _, n, _ in runs]),
    )
    assert first_mismatch(b, a) is None
    assert a.shape == (3, 2)


def test_any_flipped_byte_is_caught() -> None:
    rng = np.random.default_rng(1)
    buf = rng.integers(0, 256, 2048, dtype=np.uint8)
    addrs = np.array([buf.ctypes.data, buf.ctypes.data + 1024])
    lens = np.array([1024, 1021])
    want = digest_runs(_memory(buf), addrs, lens)
    for pos in rng.choice(2045, 100, replace=False).tolist():
        old = buf[pos]
        buf[pos] ^= 1 << int(rng.integers(0, 8))
        assert first_mismatch(digest_runs(_memory(buf), addrs, lens), want) == pos // 1024
        buf[pos] = old


def test_swapped_lanes_are_caught() -> None:
    buf = np.arange(64, dtype=np.uint64)
    addrs, lens = np.array([buf.ctypes.data]), np.array([buf.nbytes])
    want = digest_runs(_memory(buf), addrs, lens)
    buf[[3, 9]] = buf[[9, 3]]
    assert first_mismatch(digest_runs(_memory(buf), addrs, lens), want) == 0


def test_no_read_outside_the_spans() -> None:
    buf = np.zeros(64, np.uint8)
    with pytest.raises(OutOfBoundsError, match="outside the 1 mapped KV spans"):
        digest_runs(_memory(buf), np.array([buf.ctypes.data + 60]), np.array([8]))


def test_sampling_is_a_function_of_the_id() -> None:
    ids = [f"req-{i}" for i in range(4000)]
    share = sum(sampled(i, 0.125) for i in ids) / len(ids)
    assert 0.10 < share < 0.15
    assert [sampled(i, 0.125) for i in ids] == [sampled(i, 0.125) for i in ids]
    assert not any(sampled(i, 0.0) for i in ids) and all(sampled(i, 1.0) for i in ids)
