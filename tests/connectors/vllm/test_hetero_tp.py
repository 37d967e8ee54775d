"""Real engines of different TP sizes: what decode reads is prefill's, head for head.

One engine pair per model: A at TP 1 and B at TP 2, both ``kv_both``, each told the other's TP
as its prefill TP, and one proxy per direction, so the same two engines run P TP 1 -> D TP 2 and
P TP 2 -> D TP 1. Outputs across TP sizes need not equal any single engine's (TP 2 and TP 1
round differently), so the checks are: every kernel block decode reads is byte-equal to the
prefill rank(s) that hold its heads (GQA heads split or joined across ranks; MLA's latent the
same on every rank), decode computed only each prompt's last token, and both sides ended DONE.

Catches: a head slice written to the wrong D rank or at the wrong offset in D's block, a
missing sender (the manifest of a TP pairing), MLA written from the wrong rank, and any
transfer that failed and was recomputed.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
import torch

from app.harness.engines import MAX_MODEL_LEN, Instance, prompt_tokens_by_source
from app.harness.local_pd import LocalPD
from app.harness.tiny_models import write_tiny_model
from tests.connectors.vllm.conftest import (
    EngineKV,
    engines_up,
    prompt,
    read_blocks,
    whole_block_lengths,
)

MAX_TOKENS = 4
# Three engine pairs with a TP-2 engine each (a process per worker): CI runs this file apart from
# the default suite, which must stay under 30 minutes on a two-core machine (README "Tests").
pytestmark = pytest.mark.slow_engines


@dataclass(frozen=True)
class Case:
    kind: str
    overrides: dict[str, int]


# Llama with 4 KV heads (two per rank at TP 2: a slice of several heads, of which one head per
# rank is the special case; the planner's property tests run every split); a hybrid; MLA.
CASES = {
    "llama-kv4": Case("llama", {"num_key_value_heads": 4, "num_attention_heads": 8}),
    "qwen3next": Case("qwen3next", {}),
    "deepseek": Case("deepseek", {}),
}


@dataclass
class Pair:
    """Engines A (TP 1) and B (TP 2), with a proxy for each direction."""

    stack: LocalPD
    proxies: dict[str, str]  # "1to2" / "2to1" -> proxy URL

    def ends(self, direction: str) -> tuple[Instance, Instance]:
        a, b = self.stack.prefill, self.stack.decode
        return (a, b) if direction == "1to2" else (b, a)

    def sidecar_pid(self, inst: Instance) -> int:
        return self.stack.procs[f"sidecar-{inst.role}"].pid


@pytest.fixture(scope="module")
def pair(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Pair]:
    case = CASES[str(request.param)]
    root = tmp_path_factory.mktemp(f"tp-{request.param}")
    model = write_tiny_model(root / "model", case.kind, overrides=case.overrides)
    # "prefill" is A (TP 1), "decode" is B (TP 2); each is told the other's TP as prefill TP.
    stack = LocalPD(model, root / "run", recv_timeout_s=60.0, kind=case.kind, prefill_tp=1,
                    decode_tp=2)  # fmt: skip
    with engines_up(stack):
        reverse = stack.start_proxy("proxy-2to1", stack.decode, stack.prefill)
        yield Pair(stack, {"1to2": stack.proxy, "2to1": reverse})


def entries(admin: str, rid: str, side: str) -> dict[int, dict[str, object]]:
    found = httpx.get(f"{admin}/v1/requests/{rid}", timeout=10).json()["entries"]
    return {int(e["rank"]): e for e in found if e["side"] == side}


def heads_of(kv: EngineKV, name: str) -> int:
    return int(kv.view(name).shape[1])


@pytest.mark.parametrize("direction", ["2to1", "1to2"])
@pytest.mark.parametrize("pair", sorted(CASES), indirect=True)
def test_pages_follow_heads_across_tp(pair: Pair, direction: str) -> None:
    p, d = pair.ends(direction)
    p_kv = [EngineKV(p.admin, pair.sidecar_pid(p), r) for r in range(p.tp)]
    d_kv = [EngineKV(d.admin, pair.sidecar_pid(d), r) for r in range(d.tp)]
    lengths = whole_block_lengths(d_kv[0].groups, MAX_MODEL_LEN - MAX_TOKENS - 2)
    checked = 0
    # One request at a time, its pages read right after it: a finished request frees its
    # blocks on both sides, and the next one may reuse them.
    for i, n in enumerate(lengths):
        before = prompt_tokens_by_source(d.url)
        answer = pair.stack.completion(pair.proxies[direction], prompt(n - 1, 70 + i), MAX_TOKENS)
        after = prompt_tokens_by_source(d.url)
        assert after.get("local_compute", 0) - before.get("local_compute", 0) == 1
        rid = answer["kv_transfer_params"]["kv_sidecar_request_id"]
        sends, recvs = entries(p.admin, rid, "send"), entries(d.admin, rid, "recv")
        assert sorted(recvs) == list(range(d.tp)), recvs
        assert all(e["state"] == "DONE" for e in [*sends.values(), *recvs.values()]), (sends, recvs)
        # Each D rank is told the bytes it received: both sides add up to the same total.
        sent = sum(int(e["bytes"]) for e in sends.values())  # type: ignore[call-overload]
        got_bytes = sum(int(e["bytes"]) for e in recvs.values())  # type: ignore[call-overload]
        assert sent == got_bytes > 0, (sends, recvs)
        p_ids = {r: [g["block_ids"] for g in e["groups"]] for r, e in sends.items()}
        d_ids = {r: [g["block_ids"] for g in e["groups"]] for r, e in recvs.items()}
        for name, layer in d_kv[0].layers.items():
            g = layer["group"]
            group = d_kv[0].groups[g]
            if group["kind"] == "mamba":
                continue  # state: decode's own step has advanced it; the output count covers it
            blocks = read_blocks(group, d_kv[0].kernel_block_size(name), n)
            assert blocks, f"{name}: no whole kernel block below {n} tokens"
            if group["kind"] == "mla":
                # The latent is the same on every rank: each D rank holds its sender's page.
                for dr in range(d.tp):
                    src = dr * p.tp // d.tp if p.tp <= d.tp else dr * (p.tp // d.tp)
                    want = p_kv[src].pages(name, p_ids[src][g], blocks)
                    got = d_kv[dr].pages(name, d_ids[dr][g], blocks)
                    assert torch.equal(want, got), f"{rid} {name} D{dr}"
                    checked += len(blocks)
                continue
            # GQA: the model's heads in order are P ranks' heads joined, and D ranks' joined.
            want = torch.cat(
                [p_kv[r].pages(name, p_ids[r][g], blocks) for r in sorted(p_ids)], dim=1
            )
            got = torch.cat([d_kv[r].pages(name, d_ids[r][g], blocks) for r in range(d.tp)], dim=1)
            assert want.any(), f"{name}: prefill pages are empty"
            assert want.shape == got.shape, (want.shape, got.shape)
            bad = [j for k, j in enumerate(blocks) if not torch.equal(want[k], got[k])]
            assert not bad, f"{rid} {name} {direction}: kernel blocks {bad[:5]} differ"
            checked += len(blocks)
    assert checked > 0
