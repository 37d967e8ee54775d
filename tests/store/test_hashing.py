"""Chained block hashes: stable, prefix-shaped, keyed by extra keys, coarse blocks."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from app.store.hashing import (
    coarse_block_hashes,
    coarse_hash,
    group_block_hashes,
    hash_block,
    hash_block_size,
    hash_blocks,
    root_hash,
)

TOKENS = list(range(1000, 1100))

# Pinned: a change here is a change of every pool key -- bump the tags' version instead.
GOLDEN_FIRST_TWO = [
    "e210a470f66f5f861a4cfc0c6ac600bf5a1edd4fabef3f06290c1d4cd63e38d4",
    "04668b0f52c3ed900a1b71b57f0d36e51400e64c7ab70d0d8523bd2cbf43bba7",
]


def test_only_full_blocks_are_hashed_and_the_chain_is_prefix_shaped() -> None:
    hashes = hash_blocks(TOKENS[:10], 4)
    assert len(hashes) == 2  # tokens 8..9 are a partial block
    assert hash_blocks(TOKENS[:8], 4) == hashes
    assert hash_blocks(TOKENS, 4)[:2] == hashes
    assert hashes[0] == hash_block(root_hash(), TOKENS[:4])
    assert hashes[1] == hash_block(hashes[0], TOKENS[4:8])
    assert all(len(h) == 32 for h in hashes)


def test_a_token_change_changes_its_block_and_every_later_one() -> None:
    base = hash_blocks(TOKENS[:16], 4)
    changed = list(TOKENS[:16])
    changed[5] += 1
    other = hash_blocks(changed, 4)
    assert other[0] == base[0]
    assert all(a != b for a, b in zip(base[1:], other[1:], strict=True))


def test_numpy_and_list_token_ids_hash_alike() -> None:
    arr = np.asarray(TOKENS[:12], dtype=np.int32)
    assert hash_blocks(arr, 4) == hash_blocks(TOKENS[:12], 4)


def test_extra_keys_and_salt_change_hashes() -> None:
    plain = hash_blocks(TOKENS[:12], 4)
    lora = hash_blocks(TOKENS[:12], 4, extra_keys=("lora-a",))
    lora_b = hash_blocks(TOKENS[:12], 4, extra_keys=("lora-b",))
    salted = hash_blocks(TOKENS[:12], 4, cache_salt="tenant-1")
    seeded = hash_blocks(TOKENS[:12], 4, seed="deploy-2")
    for variant in (lora, lora_b, salted, seeded):
        assert all(a != b for a, b in zip(plain, variant, strict=True))
    assert all(a != b for a, b in zip(lora, lora_b, strict=True))
    # The salt goes into the first block only; the chain carries it on.
    assert salted[1] == hash_block(salted[0], TOKENS[4:8])
    assert hash_blocks(TOKENS[:12], 4, extra_keys=("lora-a",)) == lora  # deterministic


def test_extra_keys_must_encode_canonically() -> None:
    with pytest.raises(TypeError):
        hash_block(root_hash(), [1, 2], (1.5,))  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        hash_block(root_hash(), [1, 2], ({"a": 1},))  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        hash_block(b"short", [1, 2])


def test_golden_values() -> None:
    got = [h.hex() for h in hash_blocks(list(range(10)), 4)]
    assert got == GOLDEN_FIRST_TWO


def test_hashes_are_stable_across_processes() -> None:
    code = textwrap.dedent(
        """
        from app.store.hashing import hash_blocks
        hs = hash_blocks(list(range(1000, 1100)), 16, extra_keys=("lora-a", 7), cache_salt="s")
        print(",".join(h.hex() for h in hs))
        """
    )
    here = hash_blocks(TOKENS, 16, extra_keys=("lora-a", 7), cache_salt="s")
    for seed in ("0", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        out = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
            check=True,
            cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
        )
        assert out.stdout.strip().split(",") == [h.hex() for h in here]


def test_hash_block_size_is_the_gcd() -> None:
    assert hash_block_size([64, 256, 128]) == 64
    assert hash_block_size([16, 24]) == 8
    with pytest.raises(ValueError):
        hash_block_size([])


def test_coarse_block_is_named_by_its_last_fine_block_and_size() -> None:
    fine = hash_blocks(TOKENS, 4)  # 25 fine blocks
    coarse = coarse_block_hashes(fine, 4, 16)
    assert len(coarse) == 6  # 25 // 4: only complete coarse blocks
    for j, h in enumerate(coarse):
        assert h == coarse_hash(16, fine[4 * j + 3])
        assert h not in fine  # never collides with a fine name
    # Same last fine block, other coarse size: another name (another byte layout).
    assert coarse_hash(16, fine[7]) != coarse_hash(32, fine[7])
    # Ratio 1: the fine hashes themselves.
    assert coarse_block_hashes(fine, 4, 4) == fine
    with pytest.raises(ValueError):
        coarse_block_hashes(fine, 4, 6)


def test_coarse_hash_commits_to_every_token_of_the_block_and_the_prefix() -> None:
    base = coarse_block_hashes(hash_blocks(TOKENS[:64], 4), 4, 16)
    for pos in (16, 17, 22, 31):  # anywhere inside coarse block 1
        changed = list(TOKENS[:64])
        changed[pos] += 1
        other = coarse_block_hashes(hash_blocks(changed, 4), 4, 16)
        assert other[0] == base[0]
        assert other[1] != base[1] and other[2] != base[2]


def test_group_block_hashes_per_group() -> None:
    fine = hash_blocks(TOKENS, 4)
    per_group = group_block_hashes(fine, 4, [4, 8, 16])
    assert [len(g) for g in per_group] == [25, 12, 6]
    assert per_group[0] == fine
