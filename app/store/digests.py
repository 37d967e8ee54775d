"""Digests of KV pool objects (issue 51, item 4): a stored page carries its digest.

A page drawn at ``kv_digest.share`` (a hash of its key, so a save and any later load, on any
sidecar, draw alike) gets a 16-byte companion object ``<key>/kvd``: the page's digest
(``kvcache.digest``: wrapped lane sum and index-weighted lane sum) over the bytes stored.
Mooncake Store keeps no metadata on its batch paths (``put_from_with_metadata`` is single-key
and no get returns metadata), hence a companion. It is upserted only when this save stored the
page, so it is the digest of the object there now, never of an evicted predecessor's bytes
(the same tokens computed in another batch need not be bit-equal); a page that was already
pooled keeps the digest its own save wrote.

A load digests each drawn page once it landed and compares it with the companion: a mismatch
removes the object and its companion (forced past their leases: a later load must not read the
same bytes) and fails the block, which the engine recomputes. A page without a companion
(stored with the digest off, or the companion evicted alone) is loaded unchecked. A race with
another sidecar re-storing an evicted page between the get and the companion's read can only
cost a spurious recompute, never a wrong answer.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from app.kvcache.digest import (
    DigestMismatch,
    DigestStats,
    KvMemory,
    sampled,
)
from app.store.pool import PoolClient
from app.store.pool_api import StoreLike

log = logging.getLogger(__name__)

SUFFIX = "/kvd"
_WORDS = 2  # uint64 words per digest


def digest_key(key: str) -> str:
    """The companion object holding ``key``'s digest."""
    return key + SUFFIX


def drawn(keys: Sequence[str], share: float) -> list[int]:
    """Indices of the ``keys`` whose pages are digested at ``share``."""
    if share <= 0.0:
        return []
    return [i for i, k in enumerate(keys) if sampled(k, share)]


@dataclass(frozen=True)
class Page:
    """One page of a load or save: its key, where it lies in this process, and which
    (layer, group, block) of the request it is (for the log and the mismatch record)."""

    key: str
    ptr: int
    size: int
    layer: int
    group: int
    block: int


def _digests(memory: KvMemory, pages: Sequence[Page]) -> np.ndarray:
    addrs = np.fromiter((p.ptr for p in pages), np.int64, len(pages))
    sizes = np.fromiter((p.size for p in pages), np.int64, len(pages))
    return memory.digest(addrs, sizes)


async def store_digests(
    client: PoolClient, memory: KvMemory, pages: Sequence[Page], stats: DigestStats
) -> bool:
    """Digest ``pages`` (just stored by this save, still pinned by the caller) and upsert their
    companions; False when the store did not take them (the pages then load unchecked)."""
    if not pages:
        return True
    sums = await asyncio.to_thread(_digests, memory, pages)
    stats.add("pool", len(pages), sum(p.size for p in pages))
    keys = [digest_key(p.key) for p in pages]
    values = [row.astype("<u8").tobytes() for row in sums]

    def job(store: StoreLike) -> int:
        return store.upsert_batch(keys, values)

    rc = await client.run_async(job)
    if rc != 0:
        log.warning("pool: digests of %d stored pages not kept (store answered %s)", len(keys), rc)
    return rc == 0


async def check_digests(
    client: PoolClient,
    memory: KvMemory,
    pages: Sequence[Page],
    stats: DigestStats,
    kinds: Sequence[str],
) -> list[DigestMismatch]:
    """Compare ``pages`` (landed in engine memory) with their companions; each page whose
    digest differs is removed from the pool (object and companion) and returned. ``kinds``:
    each group's kind, for the mismatch counter."""
    if not pages:
        return []
    keys = [digest_key(p.key) for p in pages]

    def job(store: StoreLike) -> list[bytes]:
        return list(store.get_batch(keys))

    stored = await client.run_async(job)
    if stored is None or len(stored) != len(pages):
        return []  # the store did not answer: unchecked, as without companions
    have = [i for i, v in enumerate(stored) if len(v) == 8 * _WORDS]
    if not have:
        return []
    checked = [pages[i] for i in have]
    got = await asyncio.to_thread(_digests, memory, checked)
    stats.add("pool", len(checked), sum(p.size for p in checked))
    want = np.frombuffer(b"".join(stored[i] for i in have), "<u8").reshape(-1, _WORDS)
    bad = [checked[j] for j in np.flatnonzero((got != want).any(axis=1)).tolist()]
    if not bad:
        return []
    out = []
    for p in bad:
        kind = kinds[p.group]
        with stats.lock:
            stats.mismatches[(kind, "pool")] += 1
        log.warning(
            "pool: KV digest mismatch of %s: layer %d, group %d (%s), block %d (%d B); the "
            "object is dropped and the engine recomputes the block",
            p.key,
            p.layer,
            p.group,
            kind,
            p.block,
            p.size,
        )
        out.append(DigestMismatch(-1, p.layer, p.group, kind, p.block, p.size))
    gone = [k for p in bad for k in (p.key, digest_key(p.key))]

    def remove(store: StoreLike) -> list[int]:
        return list(store.batch_remove(gone, True))

    await client.run_async(remove)
    return out
