"""The KV pool on a sliding-window model (the tiny Gemma-3: window 64, block 128), against
the engine's own answers (issue 39).

A request that generated tokens no longer holds its window's blocks behind the window: vLLM
gave them back and the null block took their place. Its store used to read those pages from
the null block and file them under the prompt's keys, so a later hit on that prompt loaded
zeros into the window and answered otherwise than the engine. And a load rewrote every block
of the hit, the ones the engine's own prefix cache held (shared, read-only) included.

The reference is the prefill engine computing the prompt alone: a ``cache_salt`` of its own
keeps its prefix cache and the pool (which the salt keys) out of it; for a conversation, the
engine serving the whole conversation under one salt. Prefix caching is on on both engines, as
a deployment runs them.

Both engines store while a request runs (``pool_save_every`` 1, issue 54): each block boundary
a request crosses is stored while the blocks a hit there reads are still in its table. At the
end a window's tail or a GDN state is mostly given back, so a store there alone files little.
"""

from __future__ import annotations

import itertools
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import httpx
import pytest
import torch

from app.harness.engines import prompt_tokens_by_source
from app.harness.local_pd import LocalPD
from app.harness.tiny_models import write_tiny_model
from tests.conftest import wait_for
from tests.connectors.vllm.conftest import EngineKV, engines_up, prompt

pytestmark = pytest.mark.slow_engines

GEN = 16  # enough to slide the 64-token window past a prompt's tail block
WINDOW = 64  # the tiny Gemma-3's sliding window (its config, not the sidecar's view of it)
SAVE_EVERY = 1  # pool_save_every: 0 (stores at request_finished only) fails the turns tests
_salts = itertools.count()


@contextmanager
def pool_pair(factory: pytest.TempPathFactory, kind: str, *vllm_args: str) -> Iterator[LocalPD]:
    """A P/D pair of a tiny model with the KV pool, prefix caching on both engines, decode
    storing its answers (``pool_save_answers``)."""
    root = factory.mktemp(f"pool-{kind}")
    stack = LocalPD(
        write_tiny_model(root / "model", kind),
        root / "run",
        recv_timeout_s=15.0,
        kind=kind,
        pool=True,
        pool_tails=True,
        prefill_prefix_caching=True,
        decode_prefix_caching=True,
        extra_vllm_args=vllm_args,
        connector_extra={"pool_save_answers": True, "pool_save_every": SAVE_EVERY},
    )
    with engines_up(stack):
        yield stack


@pytest.fixture(scope="module")
def gemma(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalPD]:
    with pool_pair(tmp_path_factory, "gemma3") as stack:
        yield stack


def alone(pd: LocalPD, tokens: list[int], max_tokens: int) -> list[int]:
    """The prefill engine's answer computing every token itself (its own salt: no hit)."""
    body = pd.completion(pd.prefill.url, tokens, max_tokens, cache_salt=f"ref-{next(_salts)}")
    return list(body["choices"][0]["token_ids"])


def pool_metric(admin: str, name: str) -> float:
    text = httpx.get(f"{admin}/metrics", timeout=10).text
    m = re.search(rf"^kvsidecar_pool_{name}_total (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def stored(pd: LocalPD, side: str, before: float) -> None:
    """Stores run after the answer: wait until one more of ``side``'s has gone through."""
    admin = getattr(pd, side).admin
    wait_for(f"{side}'s store", lambda: pool_metric(admin, "saves") > before, 30.0, 0.2)


@pytest.mark.parametrize("tail", [20, 100], ids=["tail-held", "tail-behind-window"])
def test_decode_alone_after_a_pool_load_answers_as_the_engine(gemma: LocalPD, tail: int) -> None:
    """Prefill answers a 2-block + ``tail`` prompt (GEN tokens); decode, serving a longer
    prompt alone, hits what prefill stored. With ``tail`` = 100 the window of the last
    generated token no longer covers block 1, which a hit at 256 needs: a store at the end
    alone files nothing then (a cut store), but prefill stored 256 as its prompt's step ran,
    and the store at the end is left out (no block is full past 256)."""
    pd = gemma
    first = prompt(256 + tail, 900 + tail)
    before = pool_metric(pd.prefill.admin, "saves")
    cut = pool_metric(pd.prefill.admin, "saves_cut")
    pd.complete(pd.prefill.url, first, GEN)
    stored(pd, "prefill", before)
    # The last generated token is never computed; vLLM frees the blocks wholly before
    # computed - window + 1 (its get_num_skipped_tokens), here block 1 or not.
    computed = 256 + tail + GEN - 1
    tail_held = computed - WINDOW + 1 < 256
    assert tail_held == (tail == 20)
    assert pool_metric(pd.prefill.admin, "saves_cut") == cut

    turn = [*first, *prompt(40, 950 + tail)]
    reference = alone(pd, turn, GEN)
    loaded = prompt_tokens_by_source(pd.decode.url).get("external_kv_transfer", 0.0)
    assert pd.complete(pd.decode.url, turn, GEN) == reference
    loaded = prompt_tokens_by_source(pd.decode.url).get("external_kv_transfer", 0.0) - loaded
    assert loaded == 256


def test_prefill_after_a_pool_load_answers_as_the_engine(gemma: LocalPD) -> None:
    """Decode serves a prompt alone and stores it (one token: the window still holds its
    tail); prefill, which never saw it, loads the two blocks for a longer prompt and answers
    as the engine computing everything."""
    pd = gemma
    first = prompt(256 + 10, 1100)
    before = pool_metric(pd.decode.admin, "saves")
    pd.complete(pd.decode.url, first, 1)
    stored(pd, "decode", before)
    turn = [*first, *prompt(30, 1101)]
    reference = alone(pd, turn, GEN)
    loaded = prompt_tokens_by_source(pd.prefill.url).get("external_kv_transfer", 0.0)
    assert pd.complete(pd.prefill.url, turn, GEN) == reference
    assert prompt_tokens_by_source(pd.prefill.url).get("external_kv_transfer", 0.0) - loaded == 256


def test_conversation_turns_through_the_proxy_answer_as_one_engine(gemma: LocalPD) -> None:
    """Four turns, each appending the answer and a new message (short ones served by decode
    alone, long ones disaggregated): every answer equals one engine's holding the same
    conversation, so nothing a turn loaded (pool, or prefill's push onto decode's prefix hit)
    differs from what that engine holds.

    The reference is the prefill engine serving the conversation itself under a salt of its
    own: its cache then holds the answers' KV as it computed them, token by token, as decode's
    does. Computing an answer's tokens as part of a prompt instead rounds otherwise, enough to
    flip a greedy token of this tiny model a dozen tokens into turn 4 (measured).
    """
    pd = gemma
    salt = f"conversation-{next(_salts)}"
    history = prompt(512 + 70, 1000)
    for k, new in enumerate((0, 32, 300, 100)):
        y = [*history, *prompt(new, 1010 + k)]
        decode_alone = 0 < new < 64
        # Disaggregated, decode computes the last prompt token as a decode step: the prompt is
        # ``y`` and the engine's first token after it, which it then decodes in one step too.
        one = pd.completion(pd.prefill.url, y, GEN + (not decode_alone), cache_salt=salt)
        reference = list(one["choices"][0]["token_ids"])
        before = pool_metric(pd.decode.admin, "saves")
        if decode_alone:
            x, answer = y, pd.complete(pd.decode.url, y, GEN)
        else:
            x, reference = [*y, reference[0]], reference[1:]
            answer = pd.complete(pd.proxy, x, GEN)
        assert answer == reference, f"turn {k + 1}"
        if decode_alone:
            stored(pd, "decode", before)  # the next turn may hit what decode stored
        history = [*x, *answer]


def test_the_next_turn_loads_the_answer_decode_stored(gemma: LocalPD) -> None:
    """Three long turns through the proxy (issue 37). Decode stores each answer up to its last
    whole block as it crosses it, the window group's tail block then; the next turn's prefill
    takes every block of it and computes only the new message and the answer's last partial
    block, and every answer is the engine's own.

    Each prompt ends 120 tokens into a block, so an answer of 16 crosses into the next: without
    the answer stored, prefill's hit is a block shorter (the prompt's) and it computes that
    block again."""
    pd = gemma
    salt = f"turns-{next(_salts)}"
    groups = httpx.get(f"{pd.decode.admin}/v1/registration", timeout=10).json()["ranks"]["0"]
    window_group = next(i for i, g in enumerate(groups["groups"]) if g["kind"] == "sliding")
    history: list[int] = []
    hit = 0  # the history's prefix decode stored after the previous turn
    for k, new in enumerate((503, 239, 111)):
        y = [*history, *prompt(new, 1500 + k)]
        # As in the test above: the proxy's prompt is ``y`` and the engine's first token.
        one = pd.completion(pd.prefill.url, y, GEN + 1, cache_salt=salt)
        reference = list(one["choices"][0]["token_ids"])
        x, reference = [*y, reference[0]], reference[1:]
        assert len(x) % 128 == 120
        before = prompt_tokens_by_source(pd.prefill.url)
        sent = time.time()
        assert pd.complete(pd.proxy, x, GEN) == reference, f"turn {k + 1}"
        after = prompt_tokens_by_source(pd.prefill.url)
        if k:
            hits = ("local_cache_hit", "external_kv_transfer")  # the engine's own, the pool's
            took = sum(after.get(s, 0) - before.get(s, 0) for s in hits)
            computed = after.get("local_compute", 0) - before.get("local_compute", 0)
            assert (took, computed) == (hit, len(x) - 1 - hit), f"turn {k + 1}"
            assert computed <= new + 1 + 128  # the new message (and the proxy's token), a block
        # Decode computed all but the answer's last token: 7 tokens past a block boundary,
        # which it stored as its step crossed it, with the window's tail block before it.
        computed_end = len(x) + GEN - 1
        hit = computed_end // 128 * 128
        save = wait_for("decode's store", partial(stored_at, pd.decode.admin, sent, hit), 30.0)
        assert save["blocks"][window_group] == [hit // 128 - 1], f"turn {k + 1}"
        history = [*x, *reference]


def test_a_load_fetches_only_what_the_engine_lacks(gemma: LocalPD) -> None:
    """Decode's own cache holds block 0 of a prompt prefill stored 3 blocks of: the load fetches
    blocks 1 and 2 of the full-attention layers and the window's tail (block 2), nothing else."""
    pd = gemma
    known = prompt(3 * 128 + 10, 1200)
    before = pool_metric(pd.prefill.admin, "saves")
    pd.complete(pd.prefill.url, known, 1)
    stored(pd, "prefill", before)
    pd.complete(pd.decode.url, known[:140], 1)  # decode caches block 0 itself

    admin = pd.decode.admin
    keys, nbytes = pool_metric(admin, "load_keys"), pool_metric(admin, "load_bytes")
    local = pool_metric(admin, "load_local_blocks")
    turn = [*known, *prompt(20, 1201)]
    assert pd.complete(pd.decode.url, turn, GEN) == alone(pd, turn, GEN)
    fetched = pool_metric(admin, "load_keys") - keys
    groups = httpx.get(f"{admin}/v1/registration", timeout=10).json()["ranks"]["0"]["groups"]
    full = [g for g in groups if g["kind"] == "full"]
    window = [g for g in groups if g["kind"] == "sliding"]
    full_layers = sum(len(g["layers"]) for g in full)
    window_layers = sum(len(g["layers"]) for g in window)
    assert full_layers and window_layers
    assert fetched == 2 * full_layers + 1 * window_layers
    # A key is one layer's page of one block (the tiny Gemma-3: 2 KV heads of 64, bf16).
    assert pool_metric(admin, "load_bytes") - nbytes == fetched * 128 * 2 * 2 * 64 * 2
    # Block 0 of each full-attention group was the engine's own; nothing of the window was.
    assert pool_metric(admin, "load_local_blocks") - local == len(full)


@pytest.fixture(scope="module")
def qwen(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalPD]:
    # The GDN state dtype told to vLLM, so the test runs alike on every CPU.
    with pool_pair(tmp_path_factory, "qwen3next", "--mamba-ssm-cache-dtype", "float32") as stack:
        yield stack


def test_gdn_state_is_stored_while_the_request_holds_it(qwen: LocalPD) -> None:
    """Qwen3-Next in vLLM's ``align`` mode keeps one state block per request: once a request
    computed past a block boundary, the state at that boundary is no longer in its block table
    (the null block is), so a store at the end alone files nothing a hit could use (a cut
    store). Prefill's prompt is computed in chunks that end on block boundaries, and the one
    ending at ``bs`` is stored while its state is held; decode serving a longer prompt alone
    loads those ``bs`` tokens, state included, and answers as the engine (a null block's page
    loaded as the GDN state would not)."""
    pd = qwen
    groups = httpx.get(f"{pd.prefill.admin}/v1/registration", timeout=10).json()["ranks"]["0"]
    assert {g["mamba_mode"] for g in groups["groups"] if g["kind"] == "mamba"} == {"align"}
    bs = max(g["block_size"] for g in groups["groups"])
    first = prompt(bs + 20, 1300)
    before = pool_metric(pd.prefill.admin, "saves")
    cut = pool_metric(pd.prefill.admin, "saves_cut")
    pd.complete(pd.prefill.url, first, GEN)
    stored(pd, "prefill", before)
    assert pool_metric(pd.prefill.admin, "saves_cut") == cut

    turn = [*first, *prompt(40, 1301)]
    reference = alone(pd, turn, GEN)
    loaded = prompt_tokens_by_source(pd.decode.url).get("external_kv_transfer", 0.0)
    assert pd.complete(pd.decode.url, turn, GEN) == reference
    assert prompt_tokens_by_source(pd.decode.url).get("external_kv_transfer", 0.0) - loaded == bs


def test_an_answer_ending_on_a_block_boundary_is_stored_with_its_gdn_state(qwen: LocalPD) -> None:
    """Qwen3-Next (issue 37): decode's answer ends exactly on a block boundary, where vLLM's
    ``align`` mode holds the GDN state the request computed; decode stores the whole
    conversation, state included, and the next turn's prefill loads all of it, computes only
    the new message and answers as the engine. The turn after ends mid-block: the state
    there is no block's, so decode stores nothing (a cut save), and the third turn is still
    the engine's answer."""
    pd = qwen
    groups = httpx.get(f"{pd.decode.admin}/v1/registration", timeout=10).json()["ranks"]["0"]
    bs = max(g["block_size"] for g in groups["groups"])
    salt = f"gdn-turns-{next(_salts)}"
    history: list[int] = []
    # Turn 1's prompt (with the engine's first token) ends GEN - 1 before a boundary, so
    # decode's answer ends on it; turn 2's ends mid-block.
    ends = (2 * bs - GEN + 1, 2 * bs + bs // 2)  # the third turn: 2048 tokens at most
    hit = 0
    for k in range(3):
        new = ends[k] - len(history) - 1 if k < 2 else 40
        y = [*history, *prompt(new, 1600 + k)]
        one = pd.completion(pd.prefill.url, y, GEN + 1, cache_salt=salt)
        reference = list(one["choices"][0]["token_ids"])
        x, reference = [*y, reference[0]], reference[1:]
        before = prompt_tokens_by_source(pd.prefill.url)
        saves = pool_metric(pd.decode.admin, "saves")
        cut = pool_metric(pd.decode.admin, "saves_cut")
        assert pd.complete(pd.proxy, x, GEN) == reference, f"turn {k + 1}"
        after = prompt_tokens_by_source(pd.prefill.url)
        if k == 1:
            took = sum(
                after.get(s, 0) - before.get(s, 0)
                for s in ("local_cache_hit", "external_kv_transfer")
            )
            assert (took, after.get("local_compute", 0) - before.get("local_compute", 0)) == (
                hit,
                len(x) - 1 - hit,
            )
        stored(pd, "decode", saves)
        end = len(x) + GEN - 1  # decode computed all but the answer's last token
        if k == 0:
            assert end == 2 * bs
            save = recent(pd.decode.admin, "save")[-1]
            assert save["tokens"] == end
            assert pool_metric(pd.decode.admin, "saves_cut") == cut
            hit = end
        if k == 1:
            assert end % bs
            assert pool_metric(pd.decode.admin, "saves_cut") == cut + 1
        history = [*x, *reference]


def recent(admin: str, kind: str) -> list[dict[str, Any]]:
    calls = httpx.get(f"{admin}/v1/pool", timeout=10).json()["recent"]
    return [c for c in calls if c["kind"] == kind]


def settled(admin: str, since: float, saves: float) -> bool:
    """More stores than ``saves`` went through, and every one begun after ``since`` ended."""
    calls = [c for c in recent(admin, "save") if c["started_at"] >= since]
    return pool_metric(admin, "saves") > saves and all(c["ended_at"] for c in calls)


def stored_at(admin: str, since: float, tokens: int) -> dict[str, Any] | None:
    """The store of ``tokens`` tokens that began after ``since`` (Unix seconds), if it ended."""
    for call in recent(admin, "save"):
        if call["started_at"] >= since and call["tokens"] == tokens and call["ended_at"]:
            return call
    return None


def block_pages(kv: EngineKV, name: str, block: int) -> torch.Tensor:
    """A manager block's whole pages of layer ``name``, as bytes."""
    group = kv.groups[kv.layers[name]["group"]]
    r = group["block_size"] // group["kernel_block_size"]
    return kv.pages(name, [block], list(range(r)))


def test_a_load_writes_the_engines_own_bytes_and_nothing_else(gemma: LocalPD) -> None:
    """What a load wrote into decode's blocks is byte for byte what prefill's engine computed
    for those positions (read from both engines' own tensors, with vLLM's geometry), the
    window group's tail included; and no block decode already held changed."""
    pd = gemma
    p_kv = EngineKV(pd.prefill.admin, pd.procs["sidecar-prefill"].pid)
    d_kv = EngineKV(pd.decode.admin, pd.procs["sidecar-decode"].pid)
    known = prompt(3 * 128 + 30, 1400)
    sent = time.time()
    pd.complete(pd.prefill.url, known, 1)
    # Stored as the prompt's step ran; nothing is left for the end (no block full past 384).
    save = wait_for("prefill's store", lambda: stored_at(pd.prefill.admin, sent, 384), 30.0)
    # When the store ran, on the sidecar's clock (this host's): after the request was sent.
    assert sent <= save["started_at"] <= save["ended_at"] <= time.time()
    # Read now: prefill's freed blocks keep their bytes only until it reuses them.
    computed = {
        (name, i): block_pages(p_kv, name, save["block_ids"][layer["group"]][i])
        for name, layer in p_kv.layers.items()
        for i in save["blocks"][layer["group"]]
    }
    pd.complete(pd.decode.url, known[:140], 1)  # decode holds block 0 itself

    before = {name: d_kv.view(name).contiguous().view(torch.uint8).clone() for name in d_kv.layers}
    earlier = recent(pd.decode.admin, "save")
    loads = len(recent(pd.decode.admin, "load"))
    pd.complete(pd.decode.url, [*known, *prompt(20, 1401)], 1)
    (load,) = recent(pd.decode.admin, "load")[loads:]
    assert (load["tokens"], load["held_tokens"]) == (384, 128)
    kinds = {g["kind"] for g in d_kv.groups}
    assert kinds == {"full", "sliding"}
    for name, layer in d_kv.layers.items():
        g = layer["group"]
        loaded = load["blocks"][g]
        want = [1, 2] if d_kv.groups[g]["kind"] == "full" else [2]  # the window's tail at 384
        assert loaded == want, name
        for i in loaded:
            got = block_pages(d_kv, name, load["block_ids"][g][i])
            assert torch.equal(got, computed[(name, i)]), f"{name} block {i}"
        # Nothing the engine already held changed: its own hit (block 0 of the full group)
        # and every block decode stored for earlier prompts (still cached: this engine's
        # cache is far from full, so vLLM hands out never-used blocks first).
        after = d_kv.view(name).contiguous().view(torch.uint8)
        kb = d_kv.kernel_block_size(name)
        ratio = d_kv.groups[g]["block_size"] // kb
        changed = {
            int(k) // ratio
            for k in (after != before[name]).reshape(after.shape[0], -1).any(1).nonzero()
        }
        null = d_kv.reg["null_block"]
        held = {b for b in load["block_ids"][g][: load["held_tokens"] // 128] if b != null}
        cached = {s["block_ids"][g][i] for s in earlier for i in s["blocks"][g]}
        assert d_kv.groups[g]["kind"] != "full" or held, name
        assert not changed & (held | cached), (name, sorted(changed), sorted(held | cached))


ANSWER = 96  # long enough that the window's tail (64) and the state at the answer's
# boundary are given back before the answer ends: a store at the end alone files neither


@pytest.mark.parametrize("kind", ["gemma", "qwen"])
def test_long_answers_next_turn_computes_only_the_new_message(
    request: pytest.FixtureRequest, kind: str
) -> None:
    """Issue 54, on the window (Gemma-3) and GDN (Qwen3-Next) models as on Llama: three turns
    through the proxy, each answer ``ANSWER`` tokens crossing a block boundary 16 tokens in.
    Decode stores the boundary as its step crosses it; the next turn's prefill hits it and
    computes only the new message and the answer's part past it (at most the new message
    and one block), and every answer is the engine's own holding the same conversation.

    With stores at ``request_finished`` only (``pool_save_every`` 0) the boundary's window
    tail or GDN state is gone by then: turn 2 computes the whole history again."""
    pd: LocalPD = request.getfixturevalue(kind)
    groups = httpx.get(f"{pd.decode.admin}/v1/registration", timeout=10).json()["ranks"]["0"]
    bs = max(g["block_size"] for g in groups["groups"])
    salt = f"long-answers-{next(_salts)}"
    new = bs - ANSWER - 1  # with the proxy's token, each prompt ends 16 before a boundary
    history = prompt(max(1, 512 // bs) * bs - 17, 1700)
    hit = 0
    for k in range(3):
        y = [*history, *prompt(new if k else 0, 1710 + k)]
        one = pd.completion(pd.prefill.url, y, ANSWER + 1, cache_salt=salt)
        reference = list(one["choices"][0]["token_ids"])
        x, reference = [*y, reference[0]], reference[1:]
        assert len(x) % bs == bs - 16
        before = prompt_tokens_by_source(pd.prefill.url)
        saves = pool_metric(pd.decode.admin, "saves")
        sent = time.time()
        assert pd.complete(pd.proxy, x, ANSWER) == reference, f"turn {k + 1}"
        after = prompt_tokens_by_source(pd.prefill.url)
        if k:
            took = sum(
                after.get(s, 0) - before.get(s, 0)
                for s in ("local_cache_hit", "external_kv_transfer")
            )
            computed = after.get("local_compute", 0) - before.get("local_compute", 0)
            assert (took, computed) == (hit, len(x) - 1 - hit), f"turn {k + 1}"
            assert computed <= new + 1 + bs, f"turn {k + 1}"
        # Decode computed all but the answer's last token, and stored the boundary it crossed
        # (the next turn's hit tells: it is not waited for by name, so that stores at the end
        # alone fail on what the next turn computes).
        hit = (len(x) + ANSWER - 1) // bs * bs
        wait_for("decode's stores", partial(settled, pd.decode.admin, sent, saves), 30.0)
        history = [*x, *reference]
