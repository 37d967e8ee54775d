"""Many conversations through a small pool (issue 37: "pool memory stays within its configured
size over a 200-conversation run"): 200 two-turn conversations through the proxy, decode
storing each turn's prompt and answer, into a pool of 16 MiB (decode's segment, the only one).
The real master's own gauges, polled throughout, never show more bytes allocated than that;
it evicts, and the pool keeps serving later turns."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from app.harness.engines import prompt_tokens_by_source
from app.harness.local_pd import LocalPD
from app.harness.tiny_models import write_tiny_model
from tests.connectors.vllm.conftest import engines_up, prompt

pytestmark = pytest.mark.slow_engines

CONVERSATIONS = 200
SEGMENT = 16 << 20  # Mooncake's minimum segment
ANSWER = 16
CLIENTS = 4


def master_gauges(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=5).text
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(master_\w+) (\S+)$", text, re.M)}


@pytest.fixture(scope="module")
def small_pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalPD]:
    root = tmp_path_factory.mktemp("pd-small-pool")
    stack = LocalPD(
        write_tiny_model(root / "model", "llama"),
        root / "run",
        recv_timeout_s=15.0,
        kind="llama",
        pool=True,
        pool_tails=True,
        pool_segment_bytes=SEGMENT,
        prefill_pool_segment_bytes=0,
        extra_vllm_args=("--dtype", "float32"),
        connector_extra={"pool_save_answers": True},
    )
    with engines_up(stack):
        yield stack


def test_200_conversations_stay_within_the_pool_and_it_keeps_serving(small_pool: LocalPD) -> None:
    pd = small_pool
    assert pd.master is not None
    metrics = pd.master.metrics_url
    samples: list[dict[str, float]] = []
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            samples.append(master_gauges(metrics))
            done.wait(0.25)

    def ask(tokens: list[int]) -> list[int]:
        # ignore_eos: the random model's end of sequence would cut answers short at random.
        body = pd.completion(pd.proxy, tokens, ANSWER, ignore_eos=True)
        return list(body["choices"][0]["token_ids"])

    def conversation(c: int) -> tuple[int, int]:
        first = prompt(256, 1000 + c)
        answer = ask(first)
        second = ask(first + answer + prompt(32, 5000 + c))
        return len(answer), len(second)

    before = prompt_tokens_by_source(pd.prefill.url)
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.monotonic()
    try:
        with ThreadPoolExecutor(CLIENTS) as ex:
            lengths = list(ex.map(conversation, range(CONVERSATIONS)))
    finally:
        done.set()
        sampler.join()
    took = time.monotonic() - t0
    after = prompt_tokens_by_source(pd.prefill.url)
    end = master_gauges(metrics)
    put = sum(
        httpx.get(f"{i.admin}/v1/pool", timeout=10).json()["bytes_put"]
        for i in (pd.prefill, pd.decode)
    )
    peak = max(s["master_allocated_bytes"] for s in samples)
    loaded = after.get("external_kv_transfer", 0) - before.get("external_kv_transfer", 0)
    print(
        f"{CONVERSATIONS} conversations in {took:.0f} s; {put / 2**20:.0f} MiB stored through "
        f"{SEGMENT >> 20} MiB; peak allocated {peak / 2**20:.1f} MiB over {len(samples)} "
        f"samples; evicted {end['master_evicted_key_count']:.0f} keys "
        f"({end['master_evicted_size_bytes'] / 2**20:.0f} MiB); prefill loaded {loaded:.0f} tokens"
    )
    assert lengths == [(ANSWER, ANSWER)] * CONVERSATIONS
    assert {s["master_total_capacity_bytes"] for s in samples} == {SEGMENT}
    assert peak <= SEGMENT
    assert put > 4 * SEGMENT, "the run should push several pools' worth through"
    assert end["master_evicted_key_count"] > 0, "a full pool must evict"
    assert loaded > 0, "later turns should still load their history from the pool"
