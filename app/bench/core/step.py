"""One ``bench load`` rate step on one system: the requests sent open-loop at their scheduled
times through the system's front door, decode's (and prefill's) vLLM gauges sampled meanwhile,
then what the step cost, read the way ``bench pd`` reads a trial (``core.trial``, ``core.observe``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

import httpx

from app.bench.core.cores import descendants, proc_usage
from app.bench.core.front import prompt_key
from app.bench.core.slo import parse_metrics, series_figures, timings
from app.bench.core.stats import failed_loads, p_times, parse_histograms
from app.bench.core.systems import SIDECAR_PROCESSES, MooncakePD, System
from app.bench.core.target_path import summarize, target_times
from app.bench.core.trial import attempt, seed
from app.bench.core.workload import Request

GAUGES = (
    "vllm:kv_cache_usage_perc",
    "vllm:num_requests_waiting",
    "vllm:num_requests_running",
)
PREEMPTIONS = "vllm:num_preemptions"


def prompt_of(tokens: int, rung: int, index: int) -> list[int]:
    # core.trial's prompts (seed gives tokens - 1): distinct per request of a step, the same for
    # every system. The rung's part of the seed vanishes mod 1000, so every rung sends the same
    # prompts; the bench's engines keep no prefix cache, so one rung's cannot hit another's.
    return seed(tokens + 1, rung * 100_000 + index)


async def _one(
    client: httpx.AsyncClient, url: str, req: Request, prompt: list[int], start: float
) -> dict[str, Any]:
    out: dict[str, Any] = {"index": req.index, "prompt_tokens": req.prompt_tokens}
    out["prompt_key"] = prompt_key(prompt)  # pairs it with what the tap before P saw
    out |= {"max_tokens": req.max_tokens, "scheduled": start + req.at_s, "sent": start + req.at_s}
    cancelled = "cancelled: past the step's drain time"
    try:
        await asyncio.sleep(max(0.0, start + req.at_s - time.time()))
    except asyncio.CancelledError:
        return out | {"error": cancelled, "ended": time.time()}
    out["sent"] = time.time()  # late on a busy client: "sent" - "scheduled" says how late
    # The drawn output length, whatever the model's EOS: a request judged complete needs every
    # asked token (core.slo.judge), and an early EOS is not a missed SLO.
    return out | await attempt(client, url, prompt, req.max_tokens, cancelled, ignore_eos=True)


async def _sample(urls: dict[str, str], every_s: float, into: list[dict[str, Any]]) -> None:
    async with httpx.AsyncClient(timeout=5) as client:
        while True:
            row: dict[str, Any] = {"t": time.time()}
            for role, url in urls.items():
                try:
                    vals = parse_metrics((await client.get(f"{url}/metrics")).text, GAUGES)
                except httpx.HTTPError:
                    continue  # a missed sample, not a failed step
                row |= {f"{role}_{k.removeprefix('vllm:')}": v for k, v in vals.items()}
            into.append(row)
            await asyncio.sleep(every_s)


async def fire(
    system: System,
    requests: Sequence[Request],
    rung: int,
    drain_s: float,
    sample_s: float,
    timeout_s: float,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Every request at its time, none waiting for another (open loop); those still running
    ``drain_s`` after the last send are cancelled (and fail the SLO). The answers and the
    gauge samples."""
    samples: list[dict[str, Any]] = []
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        sampler = asyncio.create_task(
            _sample({"d": system.decode, "p": system.prefill}, sample_s, samples)
        )
        start = time.time() + 0.05
        tasks = [
            asyncio.create_task(
                _one(client, system.front, r, prompt_of(r.prompt_tokens, rung, r.index), start)
            )
            for r in requests
        ]
        last_send = start + max(r.at_s for r in requests)
        await asyncio.wait(tasks, timeout=max(0.0, last_send - time.time()) + drain_s)
        for t in tasks:
            t.cancel()
        answers = list(await asyncio.gather(*tasks))
        sampler.cancel()
        await asyncio.gather(sampler, return_exceptions=True)
    return answers, samples


def metrics(url: str) -> str:
    return httpx.get(f"{url}/metrics", timeout=10).text


def p_answered(
    answers: Sequence[dict[str, Any]], taps: Sequence[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Each answer with ``p_answered``: when P's answer to its prompt (``prompt_key``) was back
    at the tap (its last successful POST there; None when P never answered it)."""
    done: dict[str | None, float] = {}
    for t in sorted(taps, key=lambda t: t["ended"]):
        if t.get("prompt_key") is not None and t["status"] == 200:
            done[t["prompt_key"]] = t["ended"]
    return [a | {"p_answered": done.get(a["prompt_key"])} for a in answers]


def wait_idle(system: System, timeout_s: float = 60.0) -> bool:
    """Until neither engine runs or queues a request (a step's leftovers must not load the
    next); False if they still did at the timeout."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        busy = 0.0
        for url in (system.prefill, system.decode):
            vals = parse_metrics(metrics(url), GAUGES[1:])
            busy += sum(v or 0.0 for v in vals.values())
        if busy == 0:
            return True
        time.sleep(0.25)
    return False


def transfer_rss_mib(system: System) -> float | None:
    """RSS of the transfer path's own processes: kv-sidecar's two sidecars (and children);
    Mooncake's transfer engine lives inside the vLLM workers, not separable: None."""
    if isinstance(system.pd, MooncakePD):
        return None
    return proc_usage(descendants(system.pd.procs[r].pid for r in SIDECAR_PROCESSES))["rss_mib"]


def run_step(
    system: System,
    requests: Sequence[Request],
    rung: int,
    drain_s: float,
    sample_s: float,
    timeout_s: float,
) -> dict[str, Any]:
    """One rate step on one system: its requests' answers, the gauges over time and what P,
    D and the transfer path recorded in the step."""
    p0, d0 = parse_histograms(metrics(system.prefill)), metrics(system.decode)
    cpu0 = system.transfer_cpu_s()
    t0 = time.time()
    answers, samples = asyncio.run(fire(system, requests, rung, drain_s, sample_s, timeout_s))
    idle = wait_idle(system)
    time.sleep(0.2)  # the transfer agents' records of the last request
    t1 = time.time()
    answers = p_answered(answers, system.taps(t0, t1))
    cpu_s = system.transfer_cpu_s() - cpu0
    rss = transfer_rss_mib(system)
    p = p_times(p0, parse_histograms(metrics(system.prefill)))
    pre0 = parse_metrics(d0, (PREEMPTIONS,))[PREEMPTIONS]
    pre1 = parse_metrics(metrics(system.decode), (PREEMPTIONS,))[PREEMPTIONS]
    moved = system.transfers(t0, t1)
    path = None
    if not isinstance(system.pd, MooncakePD):  # kv-sidecar's proxy keeps transfer records
        proxy = httpx.get(f"{system.front}/v1/transfers", timeout=10).json()["transfers"]
        rows = target_times(
            proxy,
            moved["records"],
            [str(a["transfer_id"]) for a in answers if a.get("transfer_id")],
        )
        path = summarize(rows) | {"requests": rows}
    computed = sum(i.context_tokens for i in system.decode_steps(t0, t1))
    prompt_total = sum(r.prompt_tokens for r in requests)
    n = len(requests)
    recvs = [r for r in moved["records"] if r.get("side") == "recv"]
    return {
        "answers": answers,
        "samples": samples,
        "idle_after": idle,
        "p_prefill_ms": 1e3 * p["prefill_s"],
        "p_queue_ms": 1e3 * p["arrival_to_step_s"],
        # kv-sidecar: one layer's write (median, submitted -> landed), for handoff's bound.
        "layer_write_ms": 1e3 * moved["timeline"]["layer_write_s"]
        if moved["timeline"] is not None and moved["timeline"].get("layer_write_s") is not None
        else None,
        "preemptions": None if pre0 is None or pre1 is None else pre1 - pre0,
        "bytes": moved["bytes"],
        "transfers_landed": len(moved["landed"]),
        # kv-sidecar only: D sidecar's records that ended other than DONE.
        "transfers_failed": sum(1 for r in recvs if r.get("state") != "DONE")
        if moved["timeline"] is not None
        else None,
        "d_computed_tokens": computed,
        "recomputed_share": computed / prompt_total if prompt_total else 0.0,
        # core.stats.failed_loads for prompts of the step's mean length: an estimate here.
        "failed_loads_est": failed_loads(computed, round(prompt_total / n), n),
        "transfer_cpu_ms": 1e3 * cpu_s,
        "cpu_ms_per_request": 1e3 * cpu_s / n,
        "transfer_cpu_share": cpu_s / (t1 - t0),
        "transfer_rss_mib": rss,
        "target_path": path,
        "d_kv_usage": series_figures(samples, "d_kv_cache_usage_perc"),
        "d_waiting": series_figures(samples, "d_num_requests_waiting"),
        "p_waiting": series_figures(samples, "p_num_requests_waiting"),
    }


def unloaded(system: System, req: Request, rung: int) -> dict[str, Any]:
    """One request alone (warm-up, calibration): its TTFT, TPOT and e2e, P's own prefill."""
    p0 = parse_histograms(metrics(system.prefill))
    t0 = time.time()
    (answer,), _ = asyncio.run(fire(system, [req], rung, 600.0, 60.0, 600.0))
    wait_idle(system)
    time.sleep(0.2)  # the transfer agents' records of it
    p = p_times(p0, parse_histograms(metrics(system.prefill)))
    return {
        "system": system.name,
        "prompt_tokens": req.prompt_tokens,
        "max_tokens": req.max_tokens,
        "tokens": len(answer.get("tokens") or ()),
        "error": answer["error"],
        "p_prefill_s": p["prefill_s"],
        "bytes": system.transfers(t0, time.time())["bytes"],
    } | timings(answer)
