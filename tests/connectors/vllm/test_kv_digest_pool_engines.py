"""The KV digest of pool objects (issue 51, item 4) on real engines: every object the pool
stores holds flipped bits (``flip_sidecar --flip pool``: the engine's bytes flipped for the put
only, so the page's digest, taken after it, is of the bytes the engine computed). A later
prefill that hits those objects loads them, finds every digest differs, drops them and
recomputes its whole prompt; decode then answers exactly as the engine alone.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from app.harness import local_pd
from app.harness.engines import prompt_tokens_by_source
from app.harness.local_pd import LocalPD
from app.harness.tiny_models import write_tiny_model
from tests.conftest import wait_for
from tests.connectors.vllm.conftest import engines_up, prompt
from tests.connectors.vllm.digest_engines import TRIALS, counter
from tests.connectors.vllm.flip_sidecar import flipping

pytestmark = pytest.mark.slow_engines

MAX_TOKENS = 6
LENGTHS = [60 + 17 * (i % 20) for i in range(TRIALS)]  # each at least one whole block


@pytest.fixture(scope="module")
def pool_flipped(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalPD]:
    """The Llama pair with the KV pool on both sides (every object in decode's segment),
    every page digested, every object stored flipped."""
    root = tmp_path_factory.mktemp("digest-pool")
    stack = LocalPD(
        write_tiny_model(root / "model", "llama"),
        root / "run",
        recv_timeout_s=15.0,
        kind="llama",
        pool=True,
        pool_tails=True,
        prefill_pool_segment_bytes=0,
        extra_vllm_args=("--dtype", "float32"),
    )
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVSIDECAR_KV_DIGEST__SHARE", "1")
        swapped = flipping(local_pd.sidecar_command, "prefill,decode", "pool")
        mp.setattr(local_pd, "sidecar_command", swapped)
        with engines_up(stack):
            yield stack


def pool_stats(admin: str) -> dict[str, int]:
    return dict(httpx.get(f"{admin}/v1/pool", timeout=10).json())


def test_every_flipped_pool_object_is_dropped_and_recomputed(pool_flipped: LocalPD) -> None:
    pd = pool_flipped
    admin, url = pd.prefill.admin, pd.prefill.url
    put = pool_stats(admin)["keys_put"]
    # Prefill alone, each seed: its answer, and its prompt stored in the pool (flipped).
    pairs = [pd.reference(prompt(n, 200 + salt), MAX_TOKENS) for salt, n in enumerate(LENGTHS)]
    wait_for(
        "the prompts to be stored",
        lambda: pool_stats(admin)["keys_put"] - put >= TRIALS,
        timeout_s=60,
        interval_s=0.2,
    )
    before, got = prompt_tokens_by_source(url), pool_stats(admin)["keys_got"]
    mismatches = counter(admin, "kvsidecar_kv_digest_mismatches", side="pool")

    # seed + its first token: prefill hits the seed's stored blocks.
    assert [pd.complete(pd.proxy, x, MAX_TOKENS) for x, _ in pairs] == [a for _, a in pairs]

    after = prompt_tokens_by_source(url)
    assert pool_stats(admin)["keys_got"] > got  # the objects were loaded
    # ... and prefill computed every prompt whole (all but its last token, which decode
    # computes): none of it from the pool, each page found flipped (one count a page).
    assert after.get("external_kv_transfer", 0) == before.get("external_kv_transfer", 0)
    assert after.get("local_compute", 0) - before.get("local_compute", 0) == sum(
        len(x) - 1 for x, _ in pairs
    )
    assert counter(admin, "kvsidecar_kv_digest_mismatches", side="pool") - mismatches >= TRIALS
