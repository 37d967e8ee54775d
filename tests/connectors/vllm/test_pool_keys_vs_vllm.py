"""The pool names a block exactly where vLLM's own prefix cache does (issue 50, item 1).

A differential test over 10,000 random requests built as vLLM's scheduler holds them (``Request``
with LoRA adapters, images at random offsets, cache salts, prompt embeddings, lengths around
block boundaries), sharing prefixes often enough that equal and unequal blocks both occur by the
thousand. The truth is vLLM's block hasher (``get_request_block_hasher``); the pool's names go
the way they do in production: the connector's key runs (``pool_keys.key_runs``), through the
engine link's wire message (msgpack: tuples come back as lists), into the store's chain
(``hash_blocks`` over ``expand_key_runs``, as ``RankPool.group_hashes`` calls them). Two blocks
share a pool name exactly when their vLLM block hashes are equal, and every request vLLM would
key differently than by ids (prompt embeddings) goes without the pool.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from vllm.lora.request import LoRARequest
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.request import Request

from app.connectors.vllm.pool_keys import key_runs, without_keys
from app.store.hashing import expand_key_runs, hash_blocks
from app.store.tenants import TenantKeys
from app.transfer.wire.codec import decode, encode
from app.transfer.wire.protocol import PoolLookup

REQUESTS = 10_000
BS = 16
BASES = [[random.Random(b).randrange(1, 50_000) for _ in range(12 * BS)] for b in range(3)]
ADAPTERS = [None, ("a", "/adapters/a"), ("a", "/adapters/a-v2"), ("b", "/adapters/a")]
SALTS = [None, "tenant-1", "tenant-2"]
IMAGES = ["img-1", "img-2", "img-3"]


def _request(rng: random.Random, i: int) -> Request:
    base = rng.choice(BASES)
    length = max(1, rng.randrange(1, 12) * BS + rng.choice((-1, 0, 0, 1)))
    tokens = list(base[:length])
    if rng.random() < 0.2:  # a different token somewhere: the chains part from there
        tokens[rng.randrange(length)] = rng.randrange(50_000, 60_000)
    adapter = rng.choice(ADAPTERS)
    lora = None if adapter is None else LoRARequest(adapter[0], 1 + (adapter[0] == "b"), adapter[1])
    features = []
    if rng.random() < 0.3:
        at = 0
        for _ in range(rng.randrange(1, 3)):
            offset = rng.randrange(at, max(at + 1, length))
            size = rng.randrange(1, 2 * BS)
            if offset + size > length:
                break
            features.append(
                MultiModalFeatureSpec(
                    None, "image", rng.choice(IMAGES), PlaceholderRange(offset, size)
                )
            )
            at = offset + size
    embeds = None
    if rng.random() < 0.05:
        embeds = torch.zeros(length, 8)
    return Request(
        f"r{i}",
        None if embeds is not None and rng.random() < 0.5 else tokens,
        SamplingParams(max_tokens=1),
        None,
        prompt_embeds=embeds,
        mm_features=features or None,
        lora_request=lora,
        cache_salt=rng.choice(SALTS),
        block_hasher=None,
    )


def _pool_names(request: Request) -> list[bytes]:
    """The pool's names of the request's full blocks, the way production computes them."""
    tokens = list(request.prompt_token_ids or ())
    runs = key_runs(request, len(tokens), BS)
    assert runs is not None
    wire = decode(encode(PoolLookup(rank=0, request="r", token_ids=tokens, extra_keys=_wire(runs))))
    assert isinstance(wire, PoolLookup)
    keys = expand_key_runs(wire.extra_keys, len(tokens) // BS)
    return hash_blocks(tokens, BS, block_keys=keys)


def _wire(runs: Any) -> Any:
    return [(n, list(k)) for n, k in runs]


@pytest.fixture(scope="module")
def vllm_hasher() -> Any:
    init_none_hash(sha256)
    return get_request_block_hasher(BS, sha256)


def test_pool_names_are_equal_exactly_when_vllms_block_hashes_are(vllm_hasher: Any) -> None:
    rng = random.Random(50)
    to_pool: dict[bytes, bytes] = {}
    to_vllm: dict[bytes, bytes] = {}
    blocks = skipped = mm = 0
    for i in range(REQUESTS):
        request = _request(rng, i)
        if request.prompt_embeds is not None:
            # vLLM keys the embeddings; the connector moves no KV for them at all.
            assert without_keys(request) is not None, request.request_id
            skipped += 1
            continue
        assert without_keys(request) is None
        mm += bool(request.mm_features)
        ours = _pool_names(request)
        theirs = vllm_hasher(request)
        assert len(ours) == len(theirs)
        for a, b in zip(ours, theirs, strict=True):
            assert to_pool.setdefault(b, a) == a, f"{request.request_id}: one vLLM block, two names"
            assert to_vllm.setdefault(a, b) == b, f"{request.request_id}: one name, two vLLM blocks"
            blocks += 1
    # The comparison means something: most blocks were seen more than once, under every kind
    # of key, and prompt embeddings and images came up often.
    assert blocks > 3 * len(to_pool), (blocks, len(to_pool))
    assert len(to_pool) > 1000
    assert skipped > 300 and mm > 2000


def test_a_routers_tenant_keys_are_the_connectors_for_a_plain_prompt(vllm_hasher: Any) -> None:
    """The proxy names a plain prompt by its salt and adapter (``TenantKeys``) as the connector
    names it with vLLM's function, once the sidecar saw the adapter used."""
    rng = random.Random(7)
    tenants = TenantKeys()
    tenants.serve(["base"])
    for i in range(500):
        request = _request(rng, i)
        if request.prompt_embeds is not None or request.mm_features:
            continue
        tokens = list(request.prompt_token_ids or ())
        connector = key_runs(request, len(tokens), BS)
        assert connector is not None
        lora = request.lora_request
        model = "base" if lora is None else lora.lora_name
        tenants.learn(connector)
        router = tenants.runs(request.cache_salt, model)
        assert router is not None
        blocks = -(-len(tokens) // BS)
        expected = expand_key_runs(_wire(connector), blocks)
        assert [list(map(list, k)) for k in expand_key_runs(router, blocks)] == [
            list(map(list, k)) for k in expected
        ], request.request_id
    assert tenants.runs(None, "never-used-adapter") is None
