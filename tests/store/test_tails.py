"""Tails (a request's last partial block in the pool): their names never collide with a full
block's or with another tail's, and only models whose every group is full attention of one
block size without EAGLE take them (vLLM resumes a window, a chunk or a Mamba state only at a
block boundary)."""

from __future__ import annotations

import hashlib
import struct

import pytest

from app.store.coordinator import PoolCoordinator, PoolGroup
from app.store.hashing import hash_block, hash_blocks, root_hash, tail_hash, tail_hashes

TOKENS = list(range(2000, 2300))


def test_a_tail_is_named_by_its_parent_its_tokens_its_length_and_its_block_size() -> None:
    (first, second) = hash_blocks(TOKENS[:256], 128)
    name = tail_hash(128, second, TOKENS[256:290])
    assert name == tail_hash(128, second, TOKENS[256:290])  # stable
    assert name != hash_block(second, TOKENS[256:290])  # never a full block's name
    assert name != tail_hash(128, first, TOKENS[256:290])  # another prefix
    assert name != tail_hash(128, second, TOKENS[256:289])  # one token fewer
    assert name != tail_hash(128, second, [*TOKENS[256:289], 7])  # another last token
    assert name != tail_hash(256, second, TOKENS[256:290])  # another block size
    assert name != tail_hash(128, second, TOKENS[256:290], ("lora-a",))  # other extra keys
    assert tail_hash(128, root_hash(), TOKENS[:5]) != hash_block(root_hash(), TOKENS[:5])


def test_a_tail_is_its_block_hash_wrapped_with_the_tail_tag_and_block_size() -> None:
    """The definition, written out here apart from the module's code (its tag is part of
    every tail's pool key: changing it must be a version bump)."""
    (parent,) = hash_blocks(TOKENS[:128], 128)
    tag = b"kv-sidecar/block-hash/tail/v1\x00" + struct.pack("<Q", 128)
    inner = hash_block(parent, TOKENS[128:161], ("lora-a",))
    expected = hashlib.sha256(tag + inner).digest()
    assert tail_hash(128, parent, TOKENS[128:161], ("lora-a",)) == expected


def test_a_lookups_names_of_every_length_are_the_saves_names() -> None:
    """A lookup names all lengths at once (``tail_hashes``), a save one (``tail_hash``): if
    they ever differed, no stored tail would be found."""
    (parent,) = hash_blocks(TOKENS[:128], 128)
    extra = ("lora-a", 3)
    every = tail_hashes(128, parent, TOKENS[128:255], extra)
    assert every == [tail_hash(128, parent, TOKENS[128 : 128 + m], extra) for m in range(1, 128)]


@pytest.mark.parametrize("length", [0, 128])
def test_a_tail_is_shorter_than_a_block_and_not_empty(length: int) -> None:
    with pytest.raises(ValueError, match="1 to 127"):
        tail_hash(128, root_hash(), TOKENS[:length])


def test_only_full_attention_of_one_block_size_without_eagle_takes_tails() -> None:
    full = PoolGroup("full_attention", 128)
    assert PoolCoordinator([full]).takes_tails
    assert PoolCoordinator([full, PoolGroup("mla", 128)]).takes_tails
    assert not PoolCoordinator([full, PoolGroup("sliding_window", 128, 512)]).takes_tails
    assert not PoolCoordinator([full, PoolGroup("mamba", 128)]).takes_tails
    assert not PoolCoordinator([full, PoolGroup("full_attention", 64)]).takes_tails
    assert not PoolCoordinator([full], use_eagle=True).takes_tails
