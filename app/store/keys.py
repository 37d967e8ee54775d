"""Pool keys: what a stored block is, in at most 128 plain characters.

A key names everything that decides the bytes of one stored block:

    kvs1/<model>/<dtype>/<layout>/<tp namespace>/g<group>/<block hash, 32 hex>

* model identity (name, revision, whatever the deployment pins) and dtype;
* KV layout (e.g. ``NHD``, ``HND``, ``cross_layer``): the same tokens in another layout are other
  bytes;
* TP namespace: which slice of the block this rank holds. Ranks holding identical bytes share one
  namespace, so a block is stored once however many ranks hold it: ``rep`` for MLA / replicated
  latents (every rank), ``h<start>-<stop>`` for head-split GQA (the head range; with more ranks
  than KV heads the ranks replicating one head share it), ``s<rank>of<tp>`` for head/channel-
  sharded Mamba-style state;
* the KV cache group index and the block hash (128 bits of the sha256 chain hash: the group's
  block size is bound into the hash itself, see ``hashing``).

Parts are restricted to ``[A-Za-z0-9._-]``. A part that is too long or holds other characters is
replaced by a readable stem plus ``~`` and 12 hex digits of its sha256, so keys stay bounded and
distinct parts never collapse onto one another (``~`` never appears in a raw part).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from app.errors import ConfigError

KEY_VERSION = "kvs1"
MAX_KEY_LEN = 128
HASH_HEX_CHARS = 32
MAX_GROUP = 999

_PART_RE = re.compile(r"[A-Za-z0-9._-]+")
_BAD_CHARS_RE = re.compile(r"[^A-Za-z0-9._-]")
_KEY_RE = re.compile(r"[A-Za-z0-9._~/-]+")
_DIGEST_HEX = 12

# Per-part ceilings; with the fixed parts they add up to at most MAX_KEY_LEN.
# Each must leave room for a digested form (stem, "~", 12 hex digits).
_MAX_MODEL = 34
_MAX_DTYPE = 16
_MAX_LAYOUT = 16
_MAX_NAMESPACE = 16

RegionKind = Literal["split", "replicate", "state"]


def _bounded_part(value: str, max_len: int) -> str:
    """``value`` itself when short and plain, else a stem plus a digest of the full value."""
    if not isinstance(value, str) or not value:
        raise ConfigError(f"key part must be a non-empty string, got {value!r}")
    if len(value) <= max_len and _PART_RE.fullmatch(value):
        return value
    digest = hashlib.sha256(value.encode(errors="surrogatepass")).hexdigest()[:_DIGEST_HEX]
    stem = _BAD_CHARS_RE.sub("_", value)[: max(0, max_len - _DIGEST_HEX - 1)]
    return f"{stem}~{digest}"


@dataclass(frozen=True)
class KeyPrefix:
    """Identity of the bytes a rank stores: model, dtype, KV layout and TP namespace."""

    model: str
    dtype: str
    layout: str
    tp_namespace: str

    def __post_init__(self) -> None:
        for name in ("model", "dtype", "layout", "tp_namespace"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ConfigError(f"KeyPrefix.{name} must be a non-empty string, got {value!r}")

    def render(self) -> str:
        """The prefix as it appears in keys (bounded, validated characters)."""
        return "/".join(
            (
                KEY_VERSION,
                _bounded_part(self.model, _MAX_MODEL),
                _bounded_part(self.dtype, _MAX_DTYPE),
                _bounded_part(self.layout, _MAX_LAYOUT),
                _bounded_part(self.tp_namespace, _MAX_NAMESPACE),
            )
        )


def _key(rendered_prefix: str, group: int, block_hash: bytes) -> str:
    if isinstance(group, bool) or not isinstance(group, int) or not 0 <= group <= MAX_GROUP:
        raise ConfigError(f"group index must be an int in [0, {MAX_GROUP}], got {group!r}")
    if not isinstance(block_hash, bytes) or len(block_hash) < HASH_HEX_CHARS // 2:
        raise ConfigError(f"block hash must be at least {HASH_HEX_CHARS // 2} bytes")
    key = f"{rendered_prefix}/g{group}/{block_hash.hex()[:HASH_HEX_CHARS]}"
    # Both hold by construction; asserting keeps a later edit of the ceilings honest.
    assert len(key) <= MAX_KEY_LEN, key
    assert _KEY_RE.fullmatch(key), key
    return key


def block_key(prefix: KeyPrefix, group: int, block_hash: bytes) -> str:
    """The pool key of one block of ``group`` named by ``block_hash``."""
    return _key(prefix.render(), group, block_hash)


def block_keys(prefix: KeyPrefix, group: int, block_hashes: Sequence[bytes]) -> list[str]:
    """Keys of many blocks of one group (the prefix is rendered once)."""
    rendered = prefix.render()
    return [_key(rendered, group, h) for h in block_hashes]


def tp_namespace(
    kind: RegionKind, *, tp_size: int, rank: int, num_kv_heads: int | None = None
) -> str:
    """The namespace of ``rank``: ranks that hold identical bytes get the same one."""
    if tp_size < 1 or not 0 <= rank < tp_size:
        raise ConfigError(f"rank {rank} is not in a TP group of size {tp_size}")
    if kind == "replicate":
        return "rep"
    if kind == "state":
        return f"s{rank}of{tp_size}"
    if kind != "split":
        raise ConfigError(f"unknown region kind {kind!r}")
    if num_kv_heads is None or num_kv_heads < 1:
        raise ConfigError("a split (head-sharded) region needs num_kv_heads >= 1")
    if tp_size <= num_kv_heads:
        if num_kv_heads % tp_size:
            raise ConfigError(f"{num_kv_heads} KV heads do not split evenly over TP {tp_size}")
        per_rank = num_kv_heads // tp_size
        start = rank * per_rank
        return f"h{start}-{start + per_rank}"
    if tp_size % num_kv_heads:
        raise ConfigError(f"TP {tp_size} does not replicate {num_kv_heads} KV heads evenly")
    # More ranks than heads: consecutive ranks replicate one head and share its namespace.
    head = rank // (tp_size // num_kv_heads)
    return f"h{head}-{head + 1}"
