"""A prefix has one key whatever the block size; adapter, salt and opaque extras separate keys."""

from __future__ import annotations

import pytest

from app.proxy.kv_events.keys import KeyScheme, split_extra_keys

TOKENS = list(range(1, 65))


def test_a_prefix_has_one_key_whatever_the_blocks() -> None:
    s = KeyScheme.new(16)
    root = s.root(None, None)
    # 64 tokens as four blocks of 16 and as two of 32 (chained from the first 32's key).
    fine = s.extend(root, TOKENS)
    first = s.extend(root, TOKENS[:32])[-1]
    assert s.extend(first, TOKENS[32:])[-1] == fine[3]
    assert s.prompt(TOKENS + [99] * 15).keys == tuple(fine)  # a trailing part unit: no key
    assert s.prompt(TOKENS).tokens == 64


def test_adapter_salt_and_opaque_extras_make_other_keys() -> None:
    s = KeyScheme.new(16)
    plain = s.prompt(TOKENS).keys
    assert s.prompt(TOKENS, lora_name="a").keys[0] != plain[0]
    assert s.prompt(TOKENS, cache_salt="x").keys[0] != plain[0]
    assert s.extend(s.root(None, None), TOKENS[:16], (("img", 0),)) != [plain[0]]
    # Another process (another secret) keys the same tokens otherwise.
    assert KeyScheme.new(16).prompt(TOKENS).keys[0] != plain[0]


def test_split_extra_keys() -> None:
    # vLLM's untagged order: LoRA name, (mm id, offset) pairs, salt, prompt-embeds digests.
    assert split_extra_keys(["a", ["img", 3], "salt", b"d"], "a") == (
        "salt",
        (("img", 3), b"d"),
    )
    assert split_extra_keys(["a"], "a") == (None, None)
    assert split_extra_keys(["salt"], None) == ("salt", None)
    assert split_extra_keys(None, "a") == (None, None)


def test_units_must_be_whole() -> None:
    s = KeyScheme.new(16)
    with pytest.raises(ValueError, match="whole units of 16 tokens; got 20"):
        s.extend(0, list(range(20)))
    with pytest.raises(ValueError, match="at least 1 token; got 0"):
        KeyScheme.new(0)
