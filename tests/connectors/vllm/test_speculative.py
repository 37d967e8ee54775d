"""Speculative decoding through P/D on real engines: the drafter's KV moves with the target's.

A drafter keeps KV of its own for the prompt (vLLM registers its layers with the connector
next to the target's). Decode's first drafts attend to that KV: if prefill's never arrives,
they read blocks nobody wrote and miss, which greedy outputs never show (rejection sampling
keeps them right) but vLLM's acceptance counters do. So every check here reads both.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from app.harness.engines import MAX_MODEL_LEN, prompt_tokens_by_source
from app.harness.local_pd import LocalPD
from app.harness.tiny_models import write_tiny_eagle, write_tiny_model
from tests.connectors.vllm.conftest import (
    EngineKV,
    block_ids,
    engines_up,
    last_transfer,
    prompt,
    read_blocks,
    whole_block_lengths,
)

pytestmark = pytest.mark.slow_engines

LENGTHS = (15, 16, 17, 64, 65, 300)  # around the 16-token blocks, and a long one
MAX_TOKENS = 16
SPEC_TOKENS = 3


def spec_counts(base: str) -> dict[str, float]:
    """vLLM's speculative decoding counters: drafts, draft tokens, accepted tokens."""
    text = httpx.get(f"{base}/metrics", timeout=10).text
    counts = {"drafts": 0.0, "draft_tokens": 0.0, "accepted_tokens": 0.0}
    for key in counts:
        for m in re.finditer(rf"^vllm:spec_decode_num_{key}_total\{{[^}}]*\}} (\S+)$", text, re.M):
            counts[key] += float(m.group(1))
    return counts


def counted(base: str, before: dict[str, float]) -> dict[str, float]:
    return {k: v - before[k] for k, v in spec_counts(base).items()}


def spec_config(model: Path, method: str, tokens: int = SPEC_TOKENS) -> tuple[str, str]:
    body = {"method": method, "model": str(model), "num_speculative_tokens": tokens}
    return ("--speculative-config", json.dumps(body))


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("spec-models")
    target = write_tiny_model(root / "llama", "llama")
    # Its own KV geometry: 1 KV head where the target has 2 (vLLM keeps each layer's spec).
    eagle = write_tiny_eagle(root / "eagle", target, overrides={"num_key_value_heads": 1})
    return {"target": target, "eagle": eagle}


def stack(root: Path, model: Path, *args: str, **options: Any) -> LocalPD:
    return LocalPD(model, root, recv_timeout_s=15.0, kind="llama", extra_vllm_args=args, **options)


@pytest.fixture(scope="module")
def draft_pd(
    models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalPD]:
    """The tiny Llama as its own draft (``draft_model``): every draft is right, given its KV."""
    target = models["target"]
    run = tmp_path_factory.mktemp("spec-draft")
    with engines_up(stack(run, target, *spec_config(target, "draft_model"))) as pd:
        yield pd


def single_and_pd(pd: LocalPD, length: int, salt: int) -> tuple[list[int], dict[str, Any]]:
    """One prompt answered by the prefill engine alone and through P/D: outputs and both
    engines' speculative counters for their own run."""
    p, reference = pd.reference(prompt(length - 1, salt), MAX_TOKENS)
    before = spec_counts(pd.prefill.url)
    assert pd.complete(pd.prefill.url, p, MAX_TOKENS) == reference
    single = counted(pd.prefill.url, before)
    before = spec_counts(pd.decode.url)
    out = pd.complete(pd.proxy, p, MAX_TOKENS)
    return reference, {"out": out, "single": single, "decode": counted(pd.decode.url, before)}


def test_draft_model_acceptance_equals_one_engine(draft_pd: LocalPD) -> None:
    """Decode accepts every draft token the engine alone accepts: all of them, for a model that
    drafts for itself. Decode computed one token per prompt (the rest was transferred).

    vLLM's scheduler pads a request admitted with one token left to compute (decode's first
    step after the load) with placeholder drafts it always rejects (scheduler.py's uniform
    decode batches): at most one such draft per request is counted, and it accepts nothing.
    """
    before = prompt_tokens_by_source(draft_pd.decode.url)
    for i, n in enumerate(LENGTHS):
        reference, got = single_and_pd(draft_pd, n, 300 + i)
        assert got["out"] == reference, n
        single, decode = got["single"], got["decode"]
        assert single["accepted_tokens"] == single["draft_tokens"] > 0, (n, single)
        assert decode["accepted_tokens"] == single["accepted_tokens"], (n, single, decode)
        padded = decode["draft_tokens"] - single["draft_tokens"]
        assert padded in (0, SPEC_TOKENS), (n, single, decode)
    after = prompt_tokens_by_source(draft_pd.decode.url)
    assert after.get("local_compute", 0) - before.get("local_compute", 0) == len(LENGTHS)


def test_draft_model_blocks_equal_prefill_blocks(draft_pd: LocalPD) -> None:
    """The draft's layers decode reads are byte-equal to prefill's, like the target's."""
    assert_layers_equal(draft_pd, lambda name: name.startswith("draft_model."), 2)


def test_draft_layers_are_sent_after_the_drafter_ran(draft_pd: LocalPD) -> None:
    """vLLM writes a draft layer once per draft pass, after the target's forward, and calls
    wait_for_save only after the drafter: the draft's layers are signalled there (at the step's
    end, after every target layer), the target's as each was written."""
    answer = draft_pd.completion(draft_pd.proxy, prompt(100, 800), 2)
    rid = answer["kv_transfer_params"]["kv_sidecar_request_id"]
    reg = httpx.get(f"{draft_pd.prefill.admin}/v1/registration", timeout=10).json()
    names = [layer["name"] for layer in reg["ranks"]["0"]["layers"]]
    (send,) = [
        e
        for e in httpx.get(f"{draft_pd.prefill.admin}/v1/requests/{rid}", timeout=10).json()[
            "entries"
        ]
        if e["side"] == "send"
    ]
    assert send["state"] == "DONE", send["error"]
    signals = {names[t["layer"]]: t for t in send["layers"]}
    assert sorted(signals) == sorted(names)
    draft = {n: t for n, t in signals.items() if n.startswith("draft_model.")}
    target = {n: t for n, t in signals.items() if n not in draft}
    assert len(draft) == 2 and len(target) == 2, sorted(signals)
    assert all(t["at_step_end"] for t in draft.values()), draft
    assert not any(t["at_step_end"] for t in target.values()), target
    last_target = max(t["signalled_at"] for t in target.values())
    assert min(t["signalled_at"] for t in draft.values()) >= last_target


def assert_layers_equal(pd: LocalPD, chosen: Any, expected_layers: int) -> None:
    p_kv = EngineKV(pd.prefill.admin, pd.procs["sidecar-prefill"].pid)
    d_kv = EngineKV(pd.decode.admin, pd.procs["sidecar-decode"].pid)
    names = [n for n in d_kv.layers if chosen(n)]
    assert len(names) == expected_layers, sorted(d_kv.layers)
    groups = list(d_kv.groups)
    checked = 0
    for i, n in enumerate(whole_block_lengths(groups, MAX_MODEL_LEN - 4)):
        answer = pd.completion(pd.proxy, prompt(n, 500 + i), 2)
        rid = answer["kv_transfer_params"]["kv_sidecar_request_id"]
        p_ids = block_ids(pd.prefill.admin, rid, "send")
        d_ids = block_ids(pd.decode.admin, rid, "recv")
        for name in names:
            g = d_kv.layers[name]["group"]
            blocks = read_blocks(d_kv.groups[g], d_kv.kernel_block_size(name), n)
            want = p_kv.pages(name, p_ids[g], blocks)
            got = d_kv.pages(name, d_ids[g], blocks)
            assert want.any(), f"{name}: prefill's draft pages are empty"
            bad = [j for k, j in enumerate(blocks) if not torch.equal(want[k], got[k])]
            assert not bad, f"{rid} {name}: kernel blocks {bad} of {blocks} differ"
            checked += len(blocks)
    assert checked > 0


def test_draft_kv_left_out_shows_in_acceptance(
    models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The same pair moving only the target's layers (what connectors that ignore the drafter
    do): outputs stay right, but decode's drafts, reading unwritten KV, are rejected."""
    target = models["target"]
    run = tmp_path_factory.mktemp("spec-left-out")
    pd = stack(
        run,
        target,
        *spec_config(target, "draft_model"),
        connector_extra={"transfer_draft_kv": False},
    )
    with engines_up(pd):
        reference, got = single_and_pd(pd, 65, 400)
        assert got["out"] == reference
        assert got["single"]["accepted_tokens"] == got["single"]["draft_tokens"] > 0
        assert got["decode"]["accepted_tokens"] < got["single"]["accepted_tokens"] / 2, got


def test_eagle_head_with_its_own_kv_geometry(
    models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> None:
    """An EAGLE head whose layer has 1 KV head where the target's have 2 (vLLM keeps it in the
    target's group with a spec of its own): outputs equal, and the head's layer decode reads
    is byte-equal to prefill's."""
    run = tmp_path_factory.mktemp("spec-eagle")
    pd = stack(run, models["target"], *spec_config(models["eagle"], "eagle"))
    with engines_up(pd):
        for i, n in enumerate((17, 130)):
            reference, got = single_and_pd(pd, n, 600 + i)
            assert got["out"] == reference, n
            assert got["decode"]["draft_tokens"] > 0
        reg = httpx.get(f"{pd.decode.admin}/v1/registration", timeout=10).json()["ranks"]["0"]
        assert reg["speculative"].startswith("method=eagle "), reg["speculative"]
        heads = {la["name"]: la["total_heads"] for la in reg["layers"]}
        assert heads["model.layers.2.self_attn.attn"] == 1, heads
        assert_layers_equal(pd, lambda name: name.startswith("model.layers.2."), 1)


def test_mismatched_speculative_configs_are_refused(
    models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Prefill drafts 3 tokens, decode 2: decode's sidecar refuses the handshake, ends the load
    at once (not at its 15 s deadline) saying both settings, and decode computes the prompt
    itself, so the answer is still right."""
    target = models["target"]
    run = tmp_path_factory.mktemp("spec-mismatch")
    pd = stack(
        run,
        target,
        *spec_config(target, "draft_model"),
        decode_vllm_args=spec_config(target, "draft_model", tokens=2),
    )
    with engines_up(pd):
        p, reference = pd.reference(prompt(40, 700), 4)
        assert pd.complete(pd.proxy, p, 4) == reference
        record = last_transfer(pd.proxy)
        assert record["status"] == "recomputed", record
        assert record["total_ms"] < 1000 * pd.recv_timeout_s / 2, record
        loads = httpx.get(
            f"{pd.decode.admin}/v1/requests", params={"side": "recv", "ended": "true"}, timeout=10
        ).json()["requests"]
        (load,) = [r for r in loads if r["id"] == record["transfer_id"]]
        assert load["state"] == "FAILED", load
        assert "speculative decoding differs" in load["error"], load
        assert "num_speculative_tokens=3" in load["error"], load
        assert "num_speculative_tokens=2" in load["error"], load
