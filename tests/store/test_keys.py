"""Pool keys: bounded, deterministic, plain characters, namespaces shared where bytes are."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from app.errors import ConfigError
from app.store.hashing import hash_blocks
from app.store.keys import MAX_KEY_LEN, KeyPrefix, block_key, block_keys, tp_namespace

KEY_RE = re.compile(r"[A-Za-z0-9._~/-]+")
HASHES = hash_blocks(list(range(64)), 16)
PREFIX = KeyPrefix(model="Qwen3-8B", dtype="bfloat16", layout="HND", tp_namespace="h0-4")


def test_key_names_every_part_readably() -> None:
    key = block_key(PREFIX, 2, HASHES[0])
    assert key == f"kvs1/Qwen3-8B/bfloat16/HND/h0-4/g2/{HASHES[0].hex()[:32]}"
    assert block_keys(PREFIX, 2, HASHES) == [block_key(PREFIX, 2, h) for h in HASHES]


def test_every_part_changes_the_key() -> None:
    base = block_key(PREFIX, 0, HASHES[0])
    variants = [
        KeyPrefix("Qwen3-32B", "bfloat16", "HND", "h0-4"),
        KeyPrefix("Qwen3-8B", "float16", "HND", "h0-4"),
        KeyPrefix("Qwen3-8B", "bfloat16", "NHD", "h0-4"),
        KeyPrefix("Qwen3-8B", "bfloat16", "HND", "h4-8"),
    ]
    keys = {base, block_key(PREFIX, 1, HASHES[0]), block_key(PREFIX, 0, HASHES[1])}
    keys |= {block_key(p, 0, HASHES[0]) for p in variants}
    assert len(keys) == 7


part = st.text(min_size=1, max_size=300)


@settings(max_examples=100, deadline=None)
@given(part, part, part, part, st.integers(0, 999), st.binary(min_size=16, max_size=64))
def test_keys_are_bounded_plain_and_deterministic(
    model: str, dtype: str, layout: str, ns: str, group: int, digest: bytes
) -> None:
    prefix = KeyPrefix(model, dtype, layout, ns)
    key = block_key(prefix, group, digest)
    assert len(key) <= MAX_KEY_LEN
    assert KEY_RE.fullmatch(key)
    assert len(key.split("/")) == 7  # no part leaks a separator
    assert block_key(KeyPrefix(model, dtype, layout, ns), group, digest) == key


def test_long_or_odd_parts_are_digested_not_confused() -> None:
    a = KeyPrefix("org/" + "m" * 80 + "-a", "bf16", "HND", "rep")
    b = KeyPrefix("org/" + "m" * 80 + "-b", "bf16", "HND", "rep")
    slash = KeyPrefix("org/model", "bf16", "HND", "rep")
    underscore = KeyPrefix("org_model", "bf16", "HND", "rep")
    keys = [block_key(p, 0, HASHES[0]) for p in (a, b, slash, underscore)]
    assert len(set(keys)) == 4
    assert keys[2].split("/")[1].startswith("org_model~")  # stem kept readable
    assert keys[3].split("/")[1] == "org_model"


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((PREFIX, 1000, HASHES[0]), "group index"),
        ((PREFIX, -1, HASHES[0]), "group index"),
        ((PREFIX, 0, b"short"), "block hash"),
    ],
)
def test_bad_key_inputs_are_refused(args: tuple, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        block_key(*args)


def test_empty_prefix_part_is_refused() -> None:
    with pytest.raises(ConfigError):
        KeyPrefix("", "bf16", "HND", "rep")


def test_replicated_latent_shares_one_namespace_across_ranks() -> None:
    assert {tp_namespace("replicate", tp_size=8, rank=r) for r in range(8)} == {"rep"}


def test_split_heads_namespace_is_the_head_range() -> None:
    names = [tp_namespace("split", tp_size=4, rank=r, num_kv_heads=8) for r in range(4)]
    assert names == ["h0-2", "h2-4", "h4-6", "h6-8"]
    # A TP-2 rank holding heads 0..3 is a different slice than a TP-4 rank holding 0..1.
    assert tp_namespace("split", tp_size=2, rank=0, num_kv_heads=8) == "h0-4"


def test_ranks_replicating_one_head_share_its_namespace() -> None:
    names = [tp_namespace("split", tp_size=16, rank=r, num_kv_heads=8) for r in range(16)]
    assert names[0] == names[1] == "h0-1"
    assert names[14] == names[15] == "h7-8"
    assert len(set(names)) == 8


def test_state_namespace_is_per_shard() -> None:
    names = {tp_namespace("state", tp_size=4, rank=r) for r in range(4)}
    assert len(names) == 4
    assert tp_namespace("state", tp_size=4, rank=1) != tp_namespace("state", tp_size=2, rank=1)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"kind": "split", "tp_size": 3, "rank": 0, "num_kv_heads": 8},
        {"kind": "split", "tp_size": 12, "rank": 0, "num_kv_heads": 8},
        {"kind": "split", "tp_size": 4, "rank": 0},
        {"kind": "replicate", "tp_size": 4, "rank": 4},
    ],
)
def test_impossible_tp_layouts_are_refused(kwargs: dict) -> None:
    with pytest.raises(ConfigError):
        tp_namespace(**kwargs)
