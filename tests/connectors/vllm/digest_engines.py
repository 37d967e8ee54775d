"""Real P/D pairs whose KV is flipped in flight with the digest on every request (issue 51),
and the check that every request was caught, recomputed and answered right: shared by
``test_kv_digest_engines.py`` (attention kinds) and ``test_kv_digest_mla_gdn_engines.py``
(MLA and a GDN state), two files so that each runs in about the time CI gives one.

Every write prefill's sidecar makes carries flipped bits (``flip_sidecar --flip wire``: an
exponent bit every 256 bytes of each run). A check that stopped comparing lets decode answer
from the flipped KV: no recompute (vLLM's own ``local_compute`` count stays at one token a
prompt), no ``kv_digest_mismatch``, and answers that are all token 0.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from app.harness import local_pd
from app.harness.engines import prompt_tokens_by_source
from app.harness.local_pd import LocalPD
from app.harness.tiny_models import write_tiny_model
from tests.conftest import wait_for
from tests.connectors.vllm.conftest import engines_up, prompt
from tests.connectors.vllm.flip_sidecar import flipping

# Requests per kind, each one trial (CI: 20; issue 51's 100 a kind: KVSIDECAR_DIGEST_TRIALS=100).
TRIALS = int(os.environ.get("KVSIDECAR_DIGEST_TRIALS", "20"))
MAX_TOKENS = 6
# Longer than Gemma 3's 64-token window, across block boundaries (past 20 trials the lengths
# repeat; each prompt has a salt of its own).
LENGTHS = [40 + 13 * (i % 20) for i in range(TRIALS)]
ENGINE_ARGS = {
    "llama": ("--dtype", "float32"),
    "gemma3": (),
    "deepseek": (),
    "qwen3next": ("--mamba-ssm-cache-dtype", "float32"),
}
# Kinds whose CPU kernels answer a prompt differently batched than alone (test_pd_e2e.py's
# through_proxy): their requests go one by one, the others all at once.
ONE_BY_ONE = {"gemma3", "deepseek", "qwen3next"}


@contextmanager
def flipped_pair(kind: str, root: Path) -> Iterator[LocalPD]:
    """A P/D pair of ``kind``, every request digested, prefill's push writes flipped."""
    stack = LocalPD(
        write_tiny_model(root / "model", kind),
        root / "run",
        recv_timeout_s=15.0,
        kind=kind,
        extra_vllm_args=ENGINE_ARGS[kind],
    )
    with pytest.MonkeyPatch.context() as mp:
        # The sidecars inherit the test's environment when they start.
        mp.setenv("KVSIDECAR_KV_DIGEST__SHARE", "1")
        swapped = flipping(local_pd.sidecar_command, "prefill", "wire")
        mp.setattr(local_pd, "sidecar_command", swapped)
        with engines_up(stack):
            yield stack


def counter(url: str, name: str, **labels: str) -> float:
    """The sum of counter ``name``'s samples at ``url``/metrics whose labels include ``labels``."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(
        s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name == f"{name}_total" and labels.items() <= s.labels.items()
    )


def answers(pd: LocalPD, base: str, prompts: list[list[int]]) -> list[dict[str, Any]]:
    def one(p: list[int]) -> dict[str, Any]:
        return pd.completion(base, p, MAX_TOKENS, 120.0)

    if pd.kind in ONE_BY_ONE:
        return [one(p) for p in prompts]
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, prompts))


def tokens(body: dict[str, Any]) -> list[int]:
    return list(body["choices"][0]["token_ids"])


def settled(pd: LocalPD, n: int) -> set[tuple[str, str | None]] | None:
    """The (status, recompute_reason) of the proxy's last ``n`` records, once none is pending
    (prefill's side may end after decode answered)."""
    records = httpx.get(f"{pd.proxy}/v1/transfers", params={"limit": n}, timeout=10).json()
    out = {(r["status"], r["recompute_reason"]) for r in records["transfers"]}
    return None if any(status == "pending" for status, _ in out) else out


def assert_every_request_caught(pd: LocalPD) -> None:
    """TRIALS prompts through the proxy: each push caught at decode, each prompt recomputed
    whole there and answered as decode alone answers it; the proxy names the digest."""
    prompts = [prompt(n, salt) for salt, n in enumerate(LENGTHS)]
    # Decode's own answers, no transfer: what a recompute must give.
    reference = [tokens(b) for b in answers(pd, pd.decode.url, prompts)]
    computed = prompt_tokens_by_source(pd.decode.url).get("local_compute", 0)
    mismatches = counter(pd.decode.admin, "kvsidecar_kv_digest_mismatches", side="decode")
    caught = counter(pd.proxy, "kvproxy_recomputes", reason="kv_digest_mismatch")

    got = answers(pd, pd.proxy, prompts)

    # Each answer says its KV load failed on the digest (decode's connector, relayed).
    said = [
        (b["kv_transfer_params"]["kv_load"], b["kv_transfer_params"].get("kv_load_error"))
        for b in got
    ]
    assert set(said) == {("failed", "kv_digest_mismatch")}, said
    wrong = {i: (tokens(b), reference[i]) for i, b in enumerate(got) if tokens(b) != reference[i]}
    assert not wrong, f"answers (got, decode's own) differ at {wrong}"
    # Decode computed every prompt whole: the flipped KV was not used for any token.
    after = prompt_tokens_by_source(pd.decode.url).get("local_compute", 0)
    assert after - computed == sum(LENGTHS), (after - computed, sum(LENGTHS))
    # Decode's sidecar counted one mismatch a request, and the proxy named the digest for each.
    d_mismatches = counter(pd.decode.admin, "kvsidecar_kv_digest_mismatches", side="decode")
    assert d_mismatches - mismatches == TRIALS, d_mismatches - mismatches
    outcomes = wait_for("the proxy's records to settle", lambda: settled(pd, TRIALS), 60)
    assert outcomes == {("recomputed", "kv_digest_mismatch")}, outcomes
    named = counter(pd.proxy, "kvproxy_recomputes", reason="kv_digest_mismatch") - caught
    assert named == TRIALS, named
