"""The pool's keys on real engines (issue 50): KV is never served across checkpoints or LoRA
adapters, and a prompt-embeds request through the P/D pair is answered by decode alone.

One stack for every test here: prefill runs tiny checkpoint A, decode checkpoint B (same
config, other random weights), both on one Mooncake master with the pool (tails on), both
serving two random LoRA adapters and prompt embeddings. vLLM's own prefix cache is off on both,
so a prompt token is either computed or loaded from the pool (vLLM's prompt-token sources say
which). Every answer is checked against transformers running the same weights (the adapter
merged in by hand): an oracle that shares nothing with vLLM or the pool.
"""

from __future__ import annotations

import base64
import functools
import io
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from app.harness.engines import prompt_tokens_by_source
from app.harness.local_pd import LocalPD
from app.harness.tiny_models import write_tiny_lora, write_tiny_model
from tests.conftest import wait_for
from tests.connectors.vllm.conftest import engines_up, last_transfer, prompt
from tests.connectors.vllm.test_pool_e2e import block_size, pool_keys, pool_stats

pytestmark = pytest.mark.slow_engines

MAX_TOKENS = 8
ADAPTERS = ("a1", "a2")


@dataclass(frozen=True)
class Tenants:
    """The stack and the weights each of its engines (and adapters) answers with."""

    pd: LocalPD
    a: Path  # prefill's checkpoint
    b: Path  # decode's checkpoint
    adapters: dict[str, Path]


@pytest.fixture(scope="module")
def tenants(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Tenants]:
    root = tmp_path_factory.mktemp("pool-tenants")
    a = write_tiny_model(root / "model-a", "llama", seed=0)
    b = write_tiny_model(root / "model-b", "llama", seed=1)
    adapters = {
        name: write_tiny_lora(root / name, a, seed=i + 1) for i, name in enumerate(ADAPTERS)
    }
    stack = LocalPD(
        a,
        root / "run",
        decode_model=b,
        recv_timeout_s=15.0,
        kind="llama",
        pool=True,
        pool_tails=True,
        # float32: the answers are compared with transformers' in float32.
        extra_vllm_args=(
            "--dtype",
            "float32",
            "--enable-prompt-embeds",
            "--enable-lora",
            "--max-loras",
            "2",
            "--max-lora-rank",
            "8",
            "--lora-modules",
            *(f"{name}={path}" for name, path in adapters.items()),
        ),
    )
    with engines_up(stack):
        yield Tenants(stack, a, b, adapters)


@functools.lru_cache(maxsize=8)
def _model(model_dir: Path, adapter: Path | None) -> Any:
    """The checkpoint in transformers (float32), with the adapter's W + alpha/r * B @ A merged
    into each layer it targets."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if adapter is not None:
        config = json.loads((adapter / "adapter_config.json").read_text())
        lora = load_file(str(adapter / "adapter_model.safetensors"))
        scale = config["lora_alpha"] / config["r"]
        merged = 0
        with torch.no_grad():
            for name, weight in model.named_parameters():
                key = "base_model.model." + name.removesuffix(".weight")
                if f"{key}.lora_A.weight" in lora:
                    weight += scale * (lora[f"{key}.lora_B.weight"] @ lora[f"{key}.lora_A.weight"])
                    merged += 1
        assert merged == len(lora) // 2, f"merged {merged} of {len(lora) // 2} LoRA layers"
    return model


def own_answer(model_dir: Path, tokens: list[int], adapter: Path | None = None) -> list[int]:
    """Greedy tokens of these weights by transformers, with no cache anywhere."""
    model = _model(model_dir, adapter)
    ids = torch.tensor([tokens])
    out: list[int] = []
    with torch.no_grad():
        for _ in range(MAX_TOKENS):
            nxt = int(model(ids).logits[0, -1].argmax())
            out.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    return out


@dataclass(frozen=True)
class Served:
    """One engine's answer and where its prompt tokens came from."""

    answer: list[int]
    loaded: int  # vLLM's external_kv_transfer: here, the pool
    computed: int
    pool_hit: int  # the sidecar's own count of tokens its lookups hit


def served(pd: LocalPD, role: str, tokens: list[int], model: str = "tiny") -> Served:
    """``tokens`` to one engine alone (no transfer params: it reads the pool first, stores
    after)."""
    inst = pd.prefill if role == "prefill" else pd.decode
    before, hits = prompt_tokens_by_source(inst.url), pool_stats(inst.admin)["hit_tokens"]
    body = pd.completion(inst.url, tokens, MAX_TOKENS, model=model)
    answer = list(body["choices"][0]["token_ids"])
    after = prompt_tokens_by_source(inst.url)

    def moved(source: str) -> int:
        return int(after.get(source, 0) - before.get(source, 0))

    hit = pool_stats(inst.admin)["hit_tokens"] - hits
    return Served(answer, moved("external_kv_transfer"), moved("local_compute"), hit)


def served_and_stored(pd: LocalPD, role: str, tokens: list[int], model: str = "tiny") -> Served:
    """``served``, then waited for until the engine's save ran (keys put, or found there
    already: the caller tells which it expects)."""
    admin = (pd.prefill if role == "prefill" else pd.decode).admin
    keys = pool_keys(admin)
    out = served(pd, role, tokens, model)
    wait_for(
        f"{role} to store the prompt",
        lambda: pool_keys(admin) > keys,
        timeout_s=30.0,
        interval_s=0.2,
    )
    return out


def test_two_checkpoints_on_one_master_never_hit_each_other(tenants: Tenants) -> None:
    """Prefill (checkpoint A) stores a prompt; decode (checkpoint B, same architecture and
    shapes) asked the same prompt finds nothing of it in the pool, computes it, and answers
    as B does; the second time each engine hits its own blocks and answers as before."""
    pd, p = tenants.pd, prompt(300, 71)
    size = block_size(pd.prefill.admin)
    hit = (len(p) - 1) // size * size
    own_a, own_b = own_answer(tenants.a, p), own_answer(tenants.b, p)
    assert own_a != own_b, "the two checkpoints should answer differently"

    assert served_and_stored(pd, "prefill", p) == Served(own_a, 0, len(p), 0)
    skipped = pool_stats(pd.decode.admin)["keys_skipped"]
    # A's blocks are in the pool under A's name: B's lookup hits nothing of them.
    assert served_and_stored(pd, "decode", p) == Served(own_b, 0, len(p), 0)
    # Decode filed its own blocks: none of its keys was found there already.
    assert pool_stats(pd.decode.admin)["keys_skipped"] == skipped

    assert served(pd, "decode", p) == Served(own_b, hit, len(p) - hit, hit)
    # Positive control: A's blocks were there all along, for A.
    assert served(pd, "prefill", p) == Served(own_a, hit, len(p) - hit, hit)


def test_two_lora_adapters_never_hit_each_other(tenants: Tenants) -> None:
    """One engine, one prompt, two adapters and the base model: each finds only what it
    stored itself, and each answers as its own weights do."""
    pd, p = tenants.pd, prompt(300, 72)
    size = block_size(pd.prefill.admin)
    hit = (len(p) - 1) // size * size
    own = {name: own_answer(tenants.a, p, path) for name, path in tenants.adapters.items()}
    base = own_answer(tenants.a, p)
    assert len({tuple(own["a1"]), tuple(own["a2"]), tuple(base)}) == 3, (
        "the adapters should change the answer"
    )

    assert served_and_stored(pd, "prefill", p, "a1") == Served(own["a1"], 0, len(p), 0)
    assert served_and_stored(pd, "prefill", p, "a2") == Served(own["a2"], 0, len(p), 0)
    assert served(pd, "prefill", p, "a1") == Served(own["a1"], hit, len(p) - hit, hit)
    assert served(pd, "prefill", p, "a2") == Served(own["a2"], hit, len(p) - hit, hit)
    # The base model stored nothing of this prompt: neither adapter's blocks are its hit.
    assert served(pd, "prefill", p) == Served(base, 0, len(p), 0)


def embeds(model_dir: Path, tokens: list[int], hidden: int | None = None) -> str:
    """``prompt_embeds`` as a client sends it: base64 of ``torch.save`` of [len, hidden] float32
    rows of the checkpoint's embedding table (random rows of width ``hidden`` if given)."""
    from safetensors.torch import load_file

    if hidden is None:
        table = load_file(str(model_dir / "model.safetensors"))["model.embed_tokens.weight"]
        rows = table[tokens].float().contiguous()
    else:
        rows = torch.randn(len(tokens), hidden)
    buf = io.BytesIO()
    torch.save(rows, buf)
    return base64.b64encode(buf.getvalue()).decode()


def skips(url: str) -> float:
    """The connector's count of requests that went without the pool or a transfer for their
    prompt embeddings."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:kv_sidecar_skipped_requests_total")
        and 'reason="prompt_embeds"' in line
    )


def test_prompt_embeds_through_the_pair_are_computed_by_decode(tenants: Tenants) -> None:
    """A client's ``prompt_embeds`` through the proxy go to decode alone (no KV would move:
    the connectors have no token ids to key or bind), the pool is not asked, decode computes the
    embeddings itself, and its answer is B's answer to the tokens those rows embed (A's weights
    never touched them). The same request sent straight to prefill as a remote-decode prefill is
    answered there without a send. A malformed tensor is refused by vLLM with a 400, and both
    engines keep serving."""
    pd, p = tenants.pd, prompt(200, 73)
    engines = (pd.prefill, pd.decode)
    lookups = [pool_stats(i.admin)["lookups"] for i in engines]
    skipped = [skips(i.url) for i in engines]
    before = prompt_tokens_by_source(pd.decode.url)
    body = {"model": "tiny", "max_tokens": MAX_TOKENS, "temperature": 0, "return_token_ids": True}

    r = httpx.post(
        f"{pd.proxy}/v1/completions",
        json={**body, "prompt_embeds": embeds(tenants.b, p)},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == own_answer(tenants.b, p)
    after = prompt_tokens_by_source(pd.decode.url)
    assert after.get("external_kv_transfer", 0) == before.get("external_kv_transfer", 0)
    assert after.get("local_compute", 0) - before.get("local_compute", 0) == len(p)
    record = last_transfer(pd.proxy)
    assert (record["status"], record["prefill"]) == ("local", None), record
    assert [pool_stats(i.admin)["lookups"] for i in engines] == lookups

    # Straight to prefill, as a router of vLLM's standard flow would send it: answered, and the
    # connector neither truncates nor sends (it used to raise inside vLLM's scheduler).
    params = {"do_remote_decode": True, "transfer_id": "embeds-direct"}
    direct = httpx.post(
        f"{pd.prefill.url}/v1/completions",
        json={**body, "prompt_embeds": embeds(tenants.b, p), "kv_transfer_params": params},
        timeout=120,
    )
    assert direct.status_code == 200, direct.text

    bad = httpx.post(
        f"{pd.proxy}/v1/completions",
        json={**body, "prompt_embeds": embeds(tenants.b, p, hidden=100)},
        timeout=120,
    )
    assert bad.status_code == 400, bad.text
    assert "hidden_size" in bad.json()["error"]["message"]

    q = prompt(150, 74)
    assert served(pd, "prefill", q).answer == own_answer(tenants.a, q)
    assert served(pd, "decode", q).answer == own_answer(tenants.b, q)
    # Counted once per engine that saw it (reported with a later step: waited for).
    wait_for(
        "both connectors to count the prompt-embeds request",
        lambda: [skips(i.url) for i in engines] == [s + 1 for s in skipped],
        timeout_s=30.0,
        interval_s=0.5,
    )
    health = httpx.get(f"{pd.proxy}/health", timeout=10).json()
    for role in ("prefill", "decode"):
        (inst,) = health[role]
        # A client's malformed request is no failure of the instance.
        assert (inst["healthy"], inst["consecutive_failures"]) == (True, 0), inst
