"""The device digest (issue 51) run on CPU tensors: torch ops give the words numpy gives and an
independent pure-Python oracle gives, for batched aligned runs, unaligned runs and ragged tails
in several spans. The same ops run on CUDA/NPU tensors on a device (tests/devices)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from app.errors import OutOfBoundsError
from app.kvcache import tensor_digest
from app.kvcache.digest import HostMemory
from app.kvcache.tensor_digest import TensorMemory


def _oracle(data: bytes) -> tuple[int, int]:
    """Python integers, little-endian 8-byte lanes, zero-padded tail."""
    data += bytes(-len(data) % 8)
    lanes = [int.from_bytes(data[i : i + 8], "little") for i in range(0, len(data), 8)]
    return sum(lanes) % 2**64, sum((k + 1) * x for k, x in enumerate(lanes)) % 2**64


def _spans(sizes: list[int], seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g) for n in sizes]


def _runs(tensors: list[torch.Tensor]) -> list[tuple[int, int]]:
    """(address, length): equal aligned runs (batched), odd offsets and ragged tails (alone)."""
    a, b = (int(t.data_ptr()) for t in tensors)
    return [
        *[(a + 512 * k, 512) for k in range(6)],  # one batch
        *[(b + 4096 + 64 * k, 64) for k in range(5)],  # another length, another span
        (a + 3, 1000),
        (b + 8, 21),
        (b + 1, 7),
        (a + 8000, 192),
    ]


def _two_spans(
    seed: int,
) -> tuple[list[torch.Tensor], list[tuple[int, int]], np.ndarray, np.ndarray, TensorMemory]:
    """Two 8 KiB spans, ``_runs`` over them as arrays, and their ``TensorMemory``."""
    tensors = _spans([8192, 8192], seed)
    runs = _runs(tensors)
    addrs = np.array([r[0] for r in runs], np.int64)
    lens = np.array([r[1] for r in runs], np.int64)
    return tensors, runs, addrs, lens, TensorMemory(tuple((int(t.data_ptr()), t) for t in tensors))


def test_words_equal_the_oracle_and_numpy() -> None:
    tensors, runs, addrs, lens, mem = _two_spans(0)
    got = mem.digest(addrs, lens)
    host = HostMemory(tuple((int(t.data_ptr()), t.numel()) for t in tensors))
    assert got.dtype == np.uint64 and got.shape == (len(runs), 2)
    assert (got == host.digest(addrs, lens)).all()
    blob = [bytes(t.numpy()) for t in tensors]
    for (addr, n), words in zip(runs, got.tolist(), strict=True):
        i = 0 if tensors[0].data_ptr() <= addr < tensors[0].data_ptr() + 8192 else 1
        off = addr - int(tensors[i].data_ptr())
        assert tuple(words) == _oracle(blob[i][off : off + n]), (addr, n)


def test_batches_split_by_their_byte_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    (t,) = _spans([1 << 16], 1)
    addrs = np.array([int(t.data_ptr()) + 256 * k for k in range(200)], np.int64)
    lens = np.full(200, 256, np.int64)
    whole = TensorMemory(((int(t.data_ptr()), t),)).digest(addrs, lens)
    monkeypatch.setattr(tensor_digest, "_BATCH_BYTES", 3 * 256)  # 3 runs a batch, 67 batches
    assert (TensorMemory(((int(t.data_ptr()), t),)).digest(addrs, lens) == whole).all()
    raw = bytes(t.numpy())
    assert tuple(whole[199].tolist()) == _oracle(raw[256 * 199 : 256 * 200])


def test_a_flipped_byte_changes_the_runs_holding_it() -> None:
    tensors, runs, addrs, lens, mem = _two_spans(2)
    want = mem.digest(addrs, lens)
    for k, (addr, n) in enumerate(runs):
        i = 0 if tensors[0].data_ptr() <= addr < tensors[0].data_ptr() + 8192 else 1
        pos = addr - int(tensors[i].data_ptr()) + n - 1  # the last byte: a padded tail's too
        at = int(tensors[i].data_ptr()) + pos
        holding = [j for j, (a, m) in enumerate(runs) if a <= at < a + m]
        tensors[i][pos] ^= 0x10
        differs = (mem.digest(addrs, lens) != want).any(axis=1)
        tensors[i][pos] ^= 0x10
        assert k in holding and np.flatnonzero(differs).tolist() == holding, (addr, n)


def test_no_read_outside_the_spans() -> None:
    (t,) = _spans([64], 3)
    mem = TensorMemory(((int(t.data_ptr()), t),))
    with pytest.raises(OutOfBoundsError, match="outside the 1 mapped KV spans"):
        mem.digest(np.array([int(t.data_ptr()) + 60]), np.array([8]))
