"""Chained block hashes for the KV pool.

A block hash names the KV of one *full* block of tokens together with everything before it:
``hash_i = sha256(tag, parent = hash_{i-1}, token_ids of block i, extra_keys)``, with the first
block's parent a root derived from a fixed tag and an optional seed. Partial blocks are never
hashed into the chain (their KV is not final); a request's last partial block can be stored
as a *tail* (``tail_hash``), named apart from every full block, where every group resumes at
any token (full attention).

Stability: the input is a canonical byte string -- a fixed domain tag, the 32-byte parent, the
token count and token ids as little-endian int64, and the extra keys encoded with msgpack (which
encodes equal str / int / bytes / tuples to equal bytes). No ``hash()``, no pickle, no
``PYTHONHASHSEED``: the same tokens give the same hash in every process, on every machine and
after restarts, which is what a shared pool needs.

Extra keys are whatever else decides the KV of a block besides its tokens: exactly vLLM's own
per-block extra keys (``generate_block_hash_extra_keys``: the LoRA adapter's name and path, the
multimodal inputs overlapping the block with their offsets in it, the cache salt on the first
block, prompt embeddings), which the connector computes with vLLM's function and hands over as
*key runs* (``expand_key_runs``). A block's name then differs exactly where vLLM's block hash
differs: the chain carries every block's keys into every later block, as vLLM's does.

Hybrid models have groups with different block sizes. Hashes are computed once, at the *hash
block size* = gcd of the group block sizes, and a group with a larger block size (a multiple of
it) gets *coarse* hashes:

    coarse_j = sha256(coarse tag, block_size, fine_{(j + 1) * r - 1}),   r = block_size / hash_bs

i.e. a coarse block is named by the hash of its last fine block, wrapped with its own block size.
Why this construction:

* the last fine hash is chained, so it already commits to every token of the coarse block and to
  the whole prefix before it: nothing is lost by not concatenating the ``r`` fine hashes
  (vLLM concatenates them, which makes names ``r * 32`` bytes long);
* the result stays 32 bytes whatever ``r`` is, so pool keys stay short and bounded;
* wrapping with the block size keeps a coarse block of one deployment from ever sharing a name
  with a block of another size (e.g. the fine block that ends at the same token in a deployment
  whose group uses the hash block size directly): equal names must mean equal bytes.

Groups whose block size equals the hash block size use the fine hashes unchanged.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Iterable, Sequence
from functools import reduce
from typing import Any

import msgspec
import numpy as np

from app.errors import ProtocolError

BlockHash = bytes
"""A 32-byte sha256 digest naming one full block and its whole prefix."""

ExtraKey = str | int | bytes | None | tuple["ExtraKey", ...] | list["ExtraKey"]
"""One extra key: anything msgpack encodes canonically (no floats, no dicts). A list and a
tuple encode alike (a msgpack array): keys that crossed the wire as lists name what they did."""

BlockKeys = tuple[ExtraKey, ...]
"""The extra keys of one block (empty: none)."""

KeyRun = tuple[int, Sequence[Any]]
"""``(blocks, keys)``: the next ``blocks`` hash blocks carry ``keys``; 0 blocks: this and every
later block (a run that closes the list)."""

HASH_LEN = 32

_ROOT_TAG = b"kv-sidecar/block-hash/root/v1\x00"
_BLOCK_TAG = b"kv-sidecar/block-hash/block/v1\x00"
_COARSE_TAG = b"kv-sidecar/block-hash/coarse/v1\x00"
_TAIL_TAG = b"kv-sidecar/block-hash/tail/v1\x00"

_encoder = msgspec.msgpack.Encoder()


def _as_bytes(seed: str | bytes) -> bytes:
    return seed.encode() if isinstance(seed, str) else bytes(seed)


def _check_extra(key: object) -> None:
    # Floats and dicts have no single canonical encoding; refuse them up front rather than hash
    # something that may differ between producers.
    if key is None:
        return
    if isinstance(key, bool) or not isinstance(key, str | int | bytes | tuple | list):
        raise TypeError(f"extra key {key!r} must be str, int, bytes, None or a tuple of those")
    if isinstance(key, tuple | list):
        for k in key:
            _check_extra(k)


def expand_key_runs(runs: Sequence[KeyRun], num_blocks: int) -> list[BlockKeys]:
    """The extra keys of each of ``num_blocks`` hash blocks, from runs (``KeyRun``); no runs at
    all: no block has extra keys. Runs that stop short are an error, not a guess (a block whose
    keys are unknown must not be named as if it had none); so is a key that has no canonical
    encoding (``ProtocolError``: they come from an engine over the wire)."""
    if not runs:
        return [()] * num_blocks
    out: list[BlockKeys] = []
    for i, (count, keys) in enumerate(runs):
        block_keys = tuple(keys)
        try:
            for key in block_keys:
                _check_extra(key)
        except TypeError as e:
            raise ProtocolError(f"extra-key run {i}: {e}") from None
        if count < 0 or (count == 0 and i != len(runs) - 1):
            raise ProtocolError(
                f"extra-key run {i} covers {count} blocks: expected a positive count, or 0 "
                "(every later block) in the last run only"
            )
        if count == 0:
            return out[:num_blocks] + [block_keys] * max(0, num_blocks - len(out))
        out.extend([block_keys] * count)
    if len(out) < num_blocks:
        raise ProtocolError(
            f"the extra-key runs name {len(out)} blocks, the tokens fill {num_blocks}"
        )
    return out[:num_blocks]


def root_hash(seed: str | bytes = b"") -> BlockHash:
    """The parent hash of a request's first block; a seed namespaces a whole deployment."""
    return hashlib.sha256(_ROOT_TAG + _as_bytes(seed)).digest()


def _token_bytes(token_ids: Sequence[int] | np.ndarray) -> bytes:
    arr = np.asarray(token_ids)
    if arr.ndim != 1:
        raise ValueError("token_ids must be one-dimensional")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"token ids must be integers, got dtype {arr.dtype}")
    return arr.astype("<i8", copy=False).tobytes()


def _encoded_extra(extra_keys: Sequence[ExtraKey]) -> bytes:
    """The extra keys as hashed: checked, msgpack-encoded, length-prefixed."""
    extra = tuple(extra_keys)
    for key in extra:
        _check_extra(key)
    encoded = _encoder.encode(extra)
    return struct.pack("<Q", len(encoded)) + encoded


def _block_digest(parent: BlockHash, tokens: bytes, extra: bytes) -> BlockHash:
    if len(parent) != HASH_LEN:
        raise ValueError(f"parent hash must be {HASH_LEN} bytes, got {len(parent)}")
    h = hashlib.sha256(_BLOCK_TAG)
    h.update(parent)
    # Length prefixes keep (tokens, extra) boundaries unambiguous.
    h.update(struct.pack("<Q", len(tokens) // 8))
    h.update(tokens)
    h.update(extra)
    return h.digest()


def hash_block(
    parent: BlockHash,
    token_ids: Sequence[int] | np.ndarray,
    extra_keys: Sequence[ExtraKey] = (),
) -> BlockHash:
    """Hash one block: its parent's hash, its token ids and its extra keys."""
    return _block_digest(parent, _token_bytes(token_ids), _encoded_extra(extra_keys))


def hash_blocks(
    token_ids: Sequence[int] | np.ndarray,
    block_size: int,
    *,
    extra_keys: Sequence[ExtraKey] = (),
    cache_salt: str | None = None,
    block_keys: Sequence[BlockKeys] | None = None,
    seed: str | bytes = b"",
    parent: BlockHash | None = None,
) -> list[BlockHash]:
    """Chained hashes of every full block of ``token_ids`` (a trailing partial block is skipped).

    ``block_keys``: each block's own extra keys (``expand_key_runs``), as vLLM computes them.
    Without it, ``extra_keys`` go into every block and ``cache_salt`` into the first block of
    the request only (ignored when ``parent`` continues an earlier chain).
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    tokens = np.asarray(token_ids)
    num_full = len(tokens) // block_size
    if block_keys is not None and len(block_keys) < num_full:
        raise ValueError(f"extra keys for {len(block_keys)} blocks, the tokens fill {num_full}")
    prev = root_hash(seed) if parent is None else parent
    base_extra = tuple(extra_keys)
    out: list[BlockHash] = []
    for i in range(num_full):
        extra = base_extra
        if block_keys is not None:
            extra = tuple(block_keys[i])
        elif i == 0 and parent is None and cache_salt is not None:
            extra = (("cache_salt", cache_salt), *base_extra)
        prev = hash_block(prev, tokens[i * block_size : (i + 1) * block_size], extra)
        out.append(prev)
    return out


def tail_hash(
    block_size: int,
    parent: BlockHash,
    token_ids: Sequence[int] | np.ndarray,
    extra_keys: Sequence[ExtraKey] = (),
) -> BlockHash:
    """Name of a *tail*: the first 1 to ``block_size - 1`` tokens of the block after the chain
    ending in ``parent`` (``root_hash()`` for a request's first block). A tail is never a
    parent; it is the block hash of its tokens wrapped with its own tag and block size, so it
    never shares a name with a full block, nor with a tail of another block size."""
    if not 0 < len(token_ids) < block_size:
        raise ValueError(f"a tail holds 1 to {block_size - 1} tokens, got {len(token_ids)}")
    return tail_hashes(block_size, parent, token_ids, extra_keys)[-1]


def tail_hashes(
    block_size: int,
    parent: BlockHash,
    token_ids: Sequence[int] | np.ndarray,
    extra_keys: Sequence[ExtraKey] = (),
) -> list[BlockHash]:
    """``tail_hash`` of every prefix of ``token_ids`` (1 to ``len`` tokens, in that order):
    the tokens and extra keys are encoded once, for a lookup that tries every tail length."""
    if not len(token_ids) < block_size:
        raise ValueError(f"a tail holds 1 to {block_size - 1} tokens, got {len(token_ids)}")
    tokens = _token_bytes(token_ids)
    extra = _encoded_extra(extra_keys)
    wrap = _TAIL_TAG + struct.pack("<Q", block_size)
    return [
        hashlib.sha256(wrap + _block_digest(parent, tokens[: 8 * m], extra)).digest()
        for m in range(1, len(token_ids) + 1)
    ]


def hash_block_size(block_sizes: Iterable[int]) -> int:
    """The block size hashes are computed at: the gcd of the group block sizes."""
    sizes = list(block_sizes)
    if not sizes or any(s <= 0 for s in sizes):
        raise ValueError(f"block sizes must be a non-empty list of positive ints, got {sizes}")
    return reduce(math.gcd, sizes)


def coarse_hash(block_size: int, last_fine_hash: BlockHash) -> BlockHash:
    """Name of a coarse block of ``block_size`` tokens whose last fine block has this hash."""
    if len(last_fine_hash) != HASH_LEN:
        raise ValueError(f"fine hash must be {HASH_LEN} bytes")
    return hashlib.sha256(_COARSE_TAG + struct.pack("<Q", block_size) + last_fine_hash).digest()


def coarse_block_hashes(
    fine_hashes: Sequence[BlockHash], hash_bs: int, block_size: int
) -> list[BlockHash]:
    """Hashes of the full ``block_size`` blocks covered by fine hashes at ``hash_bs``."""
    if block_size % hash_bs != 0:
        raise ValueError(f"block size {block_size} is not a multiple of hash block {hash_bs}")
    ratio = block_size // hash_bs
    if ratio == 1:
        return list(fine_hashes)
    num_full = len(fine_hashes) // ratio
    return [coarse_hash(block_size, fine_hashes[(j + 1) * ratio - 1]) for j in range(num_full)]


def group_block_hashes(
    fine_hashes: Sequence[BlockHash], hash_bs: int, block_sizes: Sequence[int]
) -> list[list[BlockHash]]:
    """Per-group block hashes (one list per group block size) from one fine chain."""
    return [coarse_block_hashes(fine_hashes, hash_bs, bs) for bs in block_sizes]
