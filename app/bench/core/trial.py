"""One ``bench pd`` trial: a workload (1 prompt, or N at once) sent to one system's front door,
streamed, then observed the same way for both systems.

- ``ttft_ms``: client send → first streamed token, at the system's front door (its proxy).
- ``p_start_ms``: send → P's first scheduled step = (arrival at the tap before P − send) +
  P's arrival → first step (vLLM's own histograms on P: e2e − inference time, per request).
- ``p_prefill_ms``: P's scheduled → first token (vLLM's ``request_prefill_time`` on P).
- ``exposed_ms``: P done → the KV landed at D; P done is when P's answer was back at the tap.
  Landed, kv-sidecar: the last layer write P's sidecar saw land (its per-layer timeline);
  Mooncake: D's receiver marked the request finished (``mooncake_peer``). Last of the trial's
  prompts for both. Negative: the KV was at D before P's answer was back (layer-wise).
- ``exposed_d_done_ms``: P done → D's own record of the KV complete (kv-sidecar: D sidecar's
  recv record ended DONE; Mooncake: the same stamp as ``exposed_ms``).
- ``exposed_after_forward_ms`` (kv-sidecar): P's last forward ended → KV landed, both from P
  sidecar's timeline; ``layer_write_ms`` (kv-sidecar): one layer's write, submitted → landed.
- ``exposed_derived_ms``: P done (tap) → first token at the client: exposed plus D's last-token
  step and the answer's way back, the same work in both systems.
- ``bytes``: what P's transfer agent reported sending (kv-sidecar: P sidecar's send records;
  Mooncake: its sender's ``record_transfer``).
- ``transfer_cpu_ms``, ``cpu_ms_per_request``, ``cpu_s_per_gib``: CPU time of the system's
  transfer path during the trial (``core.systems.CPU_SCOPE``), from ``/proc``.

A trial counts when every output equals one of the references (``core.stats.match_reference``,
the same set for both systems), decode computed no prompt itself (``core.stats.failed_loads``,
from vLLM's per-step token counts on D) and every prompt's KV was seen landing.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Mapping, Sequence
from typing import Any

import httpx

from app.bench.core.stats import (
    Iteration,
    failed_loads,
    match_reference,
    p_times,
    parse_histograms,
)
from app.bench.core.systems import System
from app.errors import BenchError, DeadlineExceeded

NAN = float("nan")


def seed(tokens: int, k: int) -> list[int]:
    # Distinct, deterministic prompts; the reference appends P's own first token (LocalPD).
    return [(i * 37 + k * 101 + tokens) % 1000 + 1 for i in range(tokens - 1)]


async def stream(
    client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int, **extra: Any
) -> dict[str, Any]:
    """One streamed greedy completion (``extra`` joins the body): when it was sent, its first
    and last token's arrival (``time.time()``; None: none came), its tokens, and the proxy's
    transfer id (None from an engine)."""
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "return_token_ids": True,
        **extra,
    }
    sent, first, last, tokens = time.time(), None, None, list[int]()
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        transfer = r.headers.get("x-kv-transfer-id")
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ids = json.loads(line[6:])["choices"][0].get("token_ids") or []
            if ids:
                last = time.time()
                first = first or last
            tokens.extend(ids)
    return {"sent": sent, "first": first, "last": last, "tokens": tokens, "transfer_id": transfer}


async def attempt(
    client: httpx.AsyncClient,
    url: str,
    prompt: list[int],
    max_tokens: int,
    cancelled: str,
    **extra: Any,
) -> dict[str, Any]:
    """``stream`` under load: its failure kept as ``error`` (None when it answered; ``cancelled``
    when the caller cancelled it), and when it ``ended``."""
    try:
        out = await stream(client, url, prompt, max_tokens, **extra)
        out["error"] = None
    except asyncio.CancelledError:
        out = {"error": cancelled}
    except (httpx.HTTPError, ValueError, KeyError) as e:
        out = {"error": f"{type(e).__name__}: {e}"[:300]}
    out["ended"] = time.time()
    return out


async def _fire(
    url: str, prompts: Sequence[list[int]], max_tokens: int, wait_s: float
) -> list[dict[str, Any]]:
    async with httpx.AsyncClient(timeout=wait_s) as client:
        gather = asyncio.gather(*(stream(client, url, p, max_tokens) for p in prompts))
        return list(await asyncio.wait_for(gather, wait_s))


def trial_wait_s(system: System, tokens: int, prompts: int, max_tokens: int) -> float:
    """How long a trial's answers may take: every prompt prefilled twice (at P, and at D again
    where its load failed), from the prefills measured on these engines (``waits``)."""
    return system.pd.clock.wait_s(tokens, max_tokens, prefills=2 * prompts)


def unfinished(system: System, tokens: int, prompts: int, wait_s: float, why: str) -> str:
    """One line for a trial that did not finish: which, how long it was given, on what basis."""
    return (
        f"{system.name}: {prompts} x {tokens}-token prompt(s) did not finish within "
        f"{wait_s:.0f} s ({why}; the wait is bound from {system.pd.clock.basis(tokens)}); "
        f"logs in {system.pd.work}"
    )


def _p_histograms(system: System) -> dict[str, tuple[float, float]]:
    return parse_histograms(httpx.get(f"{system.prefill}/metrics", timeout=10).text)


def _ms(a: float | None, b: float | None) -> float:
    return 1e3 * (a - b) if a is not None and b is not None else NAN


def run_trial(
    system: System,
    prompts: Sequence[list[int]],
    refs: Sequence[Mapping[str, list[int]]],
    max_tokens: int,
) -> dict[str, Any]:
    """One workload on one system; every observation of it (see the module docstring)."""
    if system.before_trial is not None:
        system.before_trial()
    before = _p_histograms(system)
    cpu0 = system.transfer_cpu_s()
    tokens = len(prompts[0])
    wait = trial_wait_s(system, tokens, len(prompts), max_tokens)
    t0 = time.time()
    try:
        answers = asyncio.run(_fire(system.front, prompts, max_tokens, wait))
    except (TimeoutError, httpx.TimeoutException):
        raise DeadlineExceeded(
            unfinished(system, tokens, len(prompts), wait, "no answer")
        ) from None
    except httpx.HTTPError as e:
        why = f"{type(e).__name__}: {e}".splitlines()[0][:200]
        raise BenchError(unfinished(system, tokens, len(prompts), wait, why)) from None
    # P's answer may come after D's last token, by at most P's own prefill.
    deadline = time.monotonic() + system.pd.clock.wait_s(tokens, 1)
    while True:  # P's answer may be back after D's: wait for it (and P's stats) before reading
        taps = system.taps(t0, time.time())
        if len(taps) >= len(prompts) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    time.sleep(0.2)
    t1 = time.time()
    cpu_s = system.transfer_cpu_s() - cpu0  # before the admin calls below add to it
    p = p_times(before, _p_histograms(system))
    moved = system.transfers(t0, t1)
    steps = system.decode_steps(t0, t1)
    return figures(t0, answers, taps, p, moved, steps, refs, len(prompts[0]), cpu_s)


def figures(
    t0: float,
    answers: Sequence[Mapping[str, Any]],
    taps: Sequence[Mapping[str, Any]],
    p: Mapping[str, float],
    moved: Mapping[str, Any],
    d_steps: Sequence[Iteration],
    refs: Sequence[Mapping[str, list[int]]],
    prompt_tokens: int,
    cpu_s: float,
) -> dict[str, Any]:
    """A trial's figures from what was observed: the client's ``answers`` (sent, first token
    time, tokens), the tap's records of P, P's times (``p_times``), what the transfer agents
    recorded (``core.systems.System.transfers``), D's engine steps, the prompts' length and the
    CPU time of the transfer path."""
    prompts = len(answers)
    computed = sum(i.context_tokens for i in d_steps)
    failed = failed_loads(computed, prompt_tokens, prompts)
    p_done = max((t["ended"] for t in taps), default=None)
    first = [a["first"] or NAN for a in answers]
    arrival = [t["arrived"] - t0 for t in taps] or [NAN]
    matched = [match_reference(a["tokens"], r) for a, r in zip(answers, refs, strict=True)]
    landed = moved["landed"]
    tl = moved["timeline"]
    # kv-sidecar: landed from P's layer writes; Mooncake: its only stamp, D's receiver.
    kv_landed = tl["kv_landed"] if tl is not None else (max(landed) if landed else None)
    outputs_ok = all(m is not None for m in matched)
    gib = moved["bytes"] / 2**30
    # D's first step that computed prompt tokens (the last one, over the loaded KV): its
    # first token's compute, part of every system's handoff, and growing with the context.
    first_step = next(
        (i.elapsed_ms for i in d_steps if i.context_tokens and i.elapsed_ms is not None), NAN
    )
    return {
        "ttft_ms": 1e3 * sum(f - a["sent"] for f, a in zip(first, answers, strict=True)) / prompts,
        "p_start_ms": 1e3 * (sum(arrival) / len(arrival) + p["arrival_to_step_s"]),
        "p_prefill_ms": 1e3 * p["prefill_s"],
        "exposed_ms": _ms(kv_landed, p_done),
        "exposed_d_done_ms": _ms(tl["d_done"] if tl is not None else kv_landed, p_done),
        "exposed_after_forward_ms": _ms(kv_landed, tl["forward_end"]) if tl is not None else NAN,
        "layer_write_ms": 1e3 * tl["layer_write_s"]
        if tl is not None and tl["layer_write_s"] is not None
        else NAN,
        "exposed_derived_ms": _ms(max(first), p_done),
        "bytes": moved["bytes"],
        "transfer_cpu_ms": 1e3 * cpu_s,
        "cpu_ms_per_request": 1e3 * cpu_s / prompts,
        "cpu_s_per_gib": cpu_s / gib if gib > 0 else NAN,
        "outputs_equal": outputs_ok,
        "references_matched": matched,
        "d_computed_tokens": computed,
        "d_first_step_ms": first_step,
        "failed_loads": failed,
        "transfers_landed": len(landed),
        "counted": outputs_ok and failed == 0 and len(landed) == prompts,
        "outputs": [a["tokens"] for a in answers],
        "timeline": tl,
        "transfer_records": moved["records"],  # what the agents said, for a second look
        # Mooncake only: P's request_finished as its connector saw it -> landed (the tap's
        # "P done" is later by P's answer's way back).
        "exposed_hook_ms": _ms(max(landed), max(moved["p_finished"]))
        if landed and moved["p_finished"]
        else NAN,
    }


def line(r: Mapping[str, Any]) -> str:
    """One trial as the run prints it."""
    ok = (
        "ok"
        if r["counted"]
        else f"NOT COUNTED (references matched {r['references_matched']}, failed loads "
        f"{r['failed_loads']} (D computed {r['d_computed_tokens']} prompt tokens), landed "
        f"{r['transfers_landed']})"
    )
    head = f"{r['link']:8} rep {r['rep']} {r['workload']:5} {r['system']:14}"
    times = "  ".join(
        f"{k.removesuffix('_ms')} {r[k]:.1f}"
        for k in ("ttft_ms", "p_start_ms", "p_prefill_ms", "exposed_ms", "exposed_derived_ms")
    )
    return f"{head} {times} ms  bytes {r['bytes']}  cpu {r['transfer_cpu_ms']:.0f} ms  {ok}"
