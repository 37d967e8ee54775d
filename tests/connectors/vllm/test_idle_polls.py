"""While decode's engine waits for KV and runs no forward pass, its worker reads its finished
bell every ``idle_poll_interval_ms`` (10 ms) and asks the sidecar what finished only when the
sidecar rang it or once per ``bell.SAFETY_S`` (1 s), not on every turn of vLLM's engine loop.

The shared Llama pair (``llama_pd``): four 2000-token prompts at once through the proxy, so
decode holds all four while prefill computes them one after another. Decode's sidecar counts
the frames its engine link received (``kvsidecar_frames_total{socket="engine"}``). Unpaced,
vLLM's no-forward loop made a round trip each turn: 330 a second on a 2-core host, ~2,500 for
one 6000-token prompt (the CPU the transfer path spent beyond MooncakeConnector's); paced,
one per 10 ms (443 frames here); with the bell, one a second plus the requests' own messages.

Steps that run a forward pass ask only when rung too: decode generating a long answer asked its
sidecar once per token.
"""

from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from app.devices.bell import SAFETY_S
from app.harness.local_pd import LocalPD
from tests.connectors.vllm.conftest import prompt

REQUESTS = 4
# Per request: its expect, the forward steps that ran it (a prompt's last token, one generated),
# get_finished after each, and margin for the proxy's other calls.
PER_REQUEST = 12


def engine_frames(admin: str) -> float:
    text = httpx.get(f"{admin}/metrics", timeout=10).text
    m = re.search(r'^kvsidecar_frames_total\{socket="engine"\} (\S+)$', text, re.M)
    assert m, "decode's sidecar exports no engine-link frame counter"
    return float(m.group(1))


def test_decode_waiting_for_kv_asks_its_sidecar_only_when_rung(llama_pd: LocalPD) -> None:
    before = engine_frames(llama_pd.decode.admin)
    t0 = time.monotonic()
    with ThreadPoolExecutor(REQUESTS) as pool:
        outs = list(
            pool.map(
                lambda i: llama_pd.completion(llama_pd.proxy, prompt(2000, 4100 + i), 1),
                range(REQUESTS),
            )
        )
    took = time.monotonic() - t0
    frames = engine_frames(llama_pd.decode.admin) - before
    assert all(o["choices"][0]["text"] is not None for o in outs)
    bound = took / SAFETY_S + REQUESTS * PER_REQUEST
    print(f"{frames:.0f} frames in {took:.2f} s ({frames / took:.0f}/s); bound {bound:.0f}")
    assert frames <= bound, (frames, took)


def test_decoding_asks_its_sidecar_only_when_rung(llama_pd: LocalPD) -> None:
    """One request decoding 96 tokens: 96 forward steps at decode, which each asked
    ``get_finished`` (a frame a token); now the steps ask when rung or once a second."""
    tokens = 96
    before = engine_frames(llama_pd.decode.admin)
    t0 = time.monotonic()
    out = llama_pd.completion(llama_pd.proxy, prompt(200, 4200), tokens, ignore_eos=True)
    took = time.monotonic() - t0
    frames = engine_frames(llama_pd.decode.admin) - before
    assert len(out["choices"][0]["token_ids"]) == tokens
    bound = took / SAFETY_S + PER_REQUEST
    print(f"{frames:.0f} frames for {tokens} tokens in {took:.2f} s; bound {bound:.0f}")
    assert frames <= bound, (frames, took)
