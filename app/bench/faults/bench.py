"""``bench faults``: one kv-sidecar P/D pair (real vLLM engines, sidecars, the proxy, a Mooncake
master with the KV pool on) under open-loop load; one part at a time is killed (SIGKILL) with
transfers in flight and restarted while the load goes on (issue 38 item 4).

In order: the pair starts; warm-up and ``core.calibrate.calibrate`` (the SLO, the unloaded service
time); the references (every prompt's greedy answer on prefill alone, with a ``cache_salt`` of
their own: the pool keeps their KV apart); then per phase (the control phase first, nothing
killed) the same seeded request sequence at ``fraction`` / service time, each phase with its
own ``cache_salt`` (a phase's repeats hit the pool, the other phases' prompts do not). What
a row counts: ``faults.plan.FaultRow``; how each is observed: docs/benchmarks.md, "bench faults".
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from app.bench.core.calibrate import CALIBRATION_RUNG, calibrate
from app.bench.core.host import LOOPBACK, HostRecord, host_record, stack_engines
from app.bench.core.slo import Slo
from app.bench.core.stats import SIDECAR
from app.bench.core.step import prompt_of, unloaded, wait_idle
from app.bench.core.systems import System
from app.bench.core.trial import attempt
from app.bench.core.workload import Request
from app.bench.faults.plan import (
    CONTROL,
    FaultOptions,
    FaultRequest,
    Point,
    back_target,
    blocks_of,
    fault_row,
    goodput_back,
    outcome,
    phase_requests,
    pool_note,
)
from app.bench.faults.watch import (
    Watch,
    decode_blocks,
    in_flight,
    pool_snapshot,
    settle,
    transfers,
)
from app.harness.fault_pair import RECV_TIMEOUT_S, SIDECAR_ENV, VLLM_ARGS
from app.harness.kv_watch import changed_outside, close_breaker
from app.harness.local_pd import LocalPD
from app.harness.tiny_models import write_tiny_model

PROMPT_RUNG, PROBE_RUNG = 500, 501  # core.step.prompt_of: apart from calibration's prompts
REF_SALT = "kvs-faults-ref"


def _kill_master(pd: LocalPD) -> None:
    assert pd.master is not None  # pool=True
    pd.master.send_signal(signal.SIGKILL)
    pd.master.wait(30)


# Per fault: the kill (SIGKILL, the process tree) and the restart.
ACTIONS: dict[str, tuple[Callable[[LocalPD], None], Callable[[LocalPD], None]]] = {
    "prefill-vllm": (lambda pd: pd.kill("vllm-prefill"), lambda pd: pd.restart(pd.prefill)),
    "decode-vllm": (lambda pd: pd.kill("vllm-decode"), lambda pd: pd.restart(pd.decode)),
    "prefill-sidecar": (
        lambda pd: pd.kill("sidecar-prefill"),
        lambda pd: pd.restart_sidecar(pd.prefill),
    ),
    "decode-sidecar": (
        lambda pd: pd.kill("sidecar-decode"),
        lambda pd: pd.restart_sidecar(pd.decode),
    ),
    "master": (_kill_master, lambda pd: pd.restart_master()),
}


@dataclass(frozen=True)
class Prompt:
    tokens: tuple[int, ...]  # seed plus the engine's own first token (``LocalPD.reference``)
    reference: tuple[int, ...]  # the rest of the engine's answer, max_tokens long


def references(pd: LocalPD, reqs: tuple[FaultRequest, ...], workers: int) -> dict[int, Prompt]:
    """Each distinct prompt and its answer on prefill alone (no transfer), ``workers`` at a
    time, salted: the pool keeps these apart from the phases' prompts."""

    def one(r: FaultRequest) -> tuple[int, Prompt]:
        seed = prompt_of(r.prompt_tokens - 1, PROMPT_RUNG, r.index)
        body = pd.completion(
            pd.prefill.url,
            seed,
            r.max_tokens + 1,
            cache_salt=REF_SALT,
            ignore_eos=True,
        )
        ids = list(body["choices"][0]["token_ids"])
        return r.index, Prompt((*seed, ids[0]), tuple(ids[1:]))

    with ThreadPoolExecutor(workers) as pool:
        return dict(pool.map(one, [r for r in reqs if r.prompt == r.index]))


@dataclass
class Phase:
    """One phase's run: the load, the fault, what came back."""

    name: str
    salt: str
    started: float = 0.0
    kill_at: float | None = None
    restart_done: float | None = None
    restart_s: float | None = None
    in_flight: int = 0
    kv_from: float = 0.0  # decode's cache compared from here (decode-vllm: its restart)
    kv_before: list[np.ndarray] | None = None
    # Both sidecars' pool counters at the start, kill, restart and end.
    pool: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)
    answers: dict[int, dict[str, Any]] = field(default_factory=dict)
    launched: dict[int, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


async def _fault(
    client: httpx.AsyncClient, pd: LocalPD, ph: Phase, watch: Watch, opts: FaultOptions
) -> None:
    await asyncio.sleep(max(0.0, ph.started + opts.pre_s - time.time()))
    ph.in_flight = await in_flight(client, pd, opts.trigger_s)
    ph.notes.append(f"{ph.in_flight} send(s) part-written at the kill")
    ph.pool["kill"] = await pool_snapshot(client, pd)
    await watch.poll(client)  # the records as of the kill (a killed sidecar's die with it)
    kill, restart = ACTIONS[ph.name]
    ph.kill_at = time.time()
    await asyncio.to_thread(kill, pd)
    t0 = time.monotonic()
    try:
        await asyncio.to_thread(restart, pd)
    finally:
        ph.restart_s = time.monotonic() - t0
        ph.restart_done = time.time()
    ph.pool["restarted"] = await pool_snapshot(client, pd)
    if ph.name == "decode-vllm":  # a new cache: compared from its start, its records only
        watch.recv.clear()
        ph.kv_from = time.time()
        ph.kv_before = await asyncio.to_thread(decode_blocks, pd)


async def _one(
    client: httpx.AsyncClient, pd: LocalPD, ph: Phase, r: FaultRequest, p: Prompt
) -> None:
    out: dict[str, Any] = {"index": r.index, "prompt": r.prompt}
    out |= {"prompt_tokens": r.prompt_tokens, "max_tokens": r.max_tokens, "sent": time.time()}
    cancelled = "cancelled: past the phase's drain time"
    out |= await attempt(
        client,
        pd.proxy,
        list(p.tokens),
        r.max_tokens,
        cancelled,
        cache_salt=ph.salt,
        ignore_eos=True,
    )
    ph.answers[r.index] = out


def _points(ph: Phase, prompts: dict[int, Prompt], slo: Slo) -> list[Point]:
    done = [
        Point(a["sent"], a["ended"], outcome(a, prompts[a["prompt"]].reference, slo) == "good")
        for a in ph.answers.values()
    ]
    running = [Point(t, None, False) for i, t in ph.launched.items() if i not in ph.answers]
    return done + running


def _stop(
    ph: Phase, opts: FaultOptions, prompts: dict[int, Prompt], slo: Slo, target: float
) -> bool:
    now = time.time()
    if ph.name == CONTROL:
        return now >= ph.started + opts.control_s
    if ph.kill_at is None:
        return False
    if now >= ph.kill_at + opts.after(ph.name):
        return True  # the bounded deadline
    if ph.restart_done is None or now < ph.restart_done + opts.hold_s:
        return False  # load on after the restart, at least one hold: the pool's reconnect
    back = goodput_back(_points(ph, prompts, slo), ph.kill_at, opts.window, target, opts.hold_s)
    return back is not None


async def drive(
    pd: LocalPD,
    ph: Phase,
    reqs: tuple[FaultRequest, ...],
    prompts: dict[int, Prompt],
    slo: Slo,
    target: float,
    opts: FaultOptions,
) -> Watch:
    """The phase's load, open loop, and its fault; returns once every request ended or was
    cancelled ``drain_s`` after the last send."""
    watch = Watch(pd)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=opts.request_timeout_s, limits=limits) as client:
        ph.pool["start"] = await pool_snapshot(client, pd)
        watcher = asyncio.create_task(watch.run(client))
        ph.started = time.time() + 0.05
        fault = None
        if ph.name != CONTROL:
            fault = asyncio.create_task(_fault(client, pd, ph, watch, opts))
        tasks = []
        try:
            for r in reqs:
                await asyncio.sleep(max(0.0, ph.started + r.at_s - time.time()))
                if fault is not None and fault.done() and fault.exception() is not None:
                    break  # a restart failed: the phase ends, the run with it (run_phase)
                if _stop(ph, opts, prompts, slo, target):
                    break
                ph.launched[r.index] = time.time()
                tasks.append(asyncio.create_task(_one(client, pd, ph, r, prompts[r.prompt])))
            if tasks:
                await asyncio.wait(tasks, timeout=opts.drain_s)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if fault is not None:
                await fault  # a restart still running (the load ran out first); or its error
        finally:
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)
        await watch.poll(client)
        ph.pool["end"] = await pool_snapshot(client, pd)
    return watch


def unrecorded_blocks(pd: LocalPD, ph: Phase, watch: Watch) -> tuple[int, int]:
    """Requests decode's sidecar holds no record of (decode alone, a pool hit, its sidecar
    dead) that ended since ``kv_from``: how many, and the blocks their prompts fill."""
    n = blocks = 0
    for a in ph.answers.values():
        tid = a.get("transfer_id")
        if a["ended"] >= ph.kv_from and tid is not None and tid not in watch.recv:
            n += 1
            blocks += blocks_of(a["prompt_tokens"], a["max_tokens"])
    return n, blocks


def run_phase(
    pd: LocalPD,
    name: str,
    index: int,
    reqs: tuple[FaultRequest, ...],
    prompts: dict[int, Prompt],
    slo: Slo,
    target: float,
    opts: FaultOptions,
) -> dict[str, Any]:
    """One phase: settled and idle first, decode's cache copied, the load and the fault, the
    drain, the checks; its record (row and requests)."""
    system = System(SIDECAR, pd, front=pd.proxy)
    wait_idle(system)
    for role in ("prefill", "decode"):
        close_breaker(pd, role, lambda i: prompt_of(400, PROBE_RUNG, i))
    settle(pd, opts.settle_s)
    ph = Phase(name, f"faults-{opts.seed}-{index}")
    ph.kv_before = decode_blocks(pd)
    ph.kv_from = time.time()
    failure: BaseException | None = None
    try:
        watch = asyncio.run(drive(pd, ph, reqs, prompts, slo, target, opts))
    except Exception as e:  # a failed restart: this row says so, the run stops after it
        failure, watch = e, Watch(pd)
        ph.notes.append(f"restart failed: {type(e).__name__}: {e}"[:300])
    held = settle(pd, opts.settle_s)
    lost_records = sum(len(v) for v in held.values())
    if lost_records:
        ph.notes.append(
            "not ended after the drain: " + ", ".join(f"{k} {len(v)}" for k, v in held.items())
        )
    changed = None
    n_alone, alone_blocks = unrecorded_blocks(pd, ph, watch)
    if ph.kv_before is not None and failure is None:
        try:
            changed = changed_outside(ph.kv_before, decode_blocks(pd), watch.inside())
        except (AssertionError, KeyError, httpx.HTTPError) as e:  # e.g. not registered again
            ph.notes.append(f"decode's cache not compared: {type(e).__name__}: {e}"[:200])
    by_tid = transfers(pd)
    seen = [by_tid[a["transfer_id"]] for a in ph.answers.values() if a.get("transfer_id") in by_tid]
    alone = sum(1 for t in seen if t["prefill"] is None)
    failed_loads = sum(1 for t in seen if t["kv_load"] == "failed")
    ph.notes.append(
        f"{n_alone} without a decode record ({alone_blocks} blocks); {alone} by decode alone, "
        f"{failed_loads} recomputed after a failed load"
    )
    pool = pool_note(ph.pool)
    if pool:
        ph.notes.append(pool)
    row = fault_row(
        name,
        sorted(ph.answers.values(), key=lambda a: a["sent"]),
        {i: prompts[ph.answers[i]["prompt"]].reference for i in ph.answers},
        slo,
        ph.kill_at,
        window=opts.window,
        target=target,
        hold_s=opts.hold_s,
        lost_records=lost_records,
        changed=changed,
        alone_blocks=alone_blocks,
        restart_s=ph.restart_s,
        notes=ph.notes,
    )
    refs = {i: prompts[a["prompt"]].reference for i, a in ph.answers.items()}
    record = {
        "row": row.as_dict(),
        "salt": ph.salt,
        "started": ph.started,
        "kill_at": ph.kill_at,
        "restart_done": ph.restart_done,
        "pool": ph.pool,
        "requests": [
            {k: v for k, v in a.items() if k != "tokens"}
            | {"tokens": len(a.get("tokens") or ()), "outcome": outcome(a, refs[a["index"]], slo)}
            for a in sorted(ph.answers.values(), key=lambda a: a["sent"])
        ],
    }
    if failure is not None:
        record["failed"] = True
    return record


def run(opts: FaultOptions) -> tuple[dict[str, Any], HostRecord]:
    """The whole bench (module docstring); the JSON ``report_run`` writes."""
    out = Path(opts.out)
    work = out / "work"
    os.environ.update(SIDECAR_ENV)  # LocalPD's processes inherit the environment
    lengths = opts.lengths
    model = write_tiny_model(work / "model", "llama")
    t = {"start": time.time()}
    pd = LocalPD(
        model,
        work / "run",
        recv_timeout_s=RECV_TIMEOUT_S,
        kind="llama",
        extra_vllm_args=VLLM_ARGS,
        pool=True,
    )
    phases: list[dict[str, Any]] = []
    result: dict[str, Any] = {"options": asdict(opts), "phases": phases, "logs": str(work)}
    try:
        pd.start()
        t["engines_up"] = time.time()
        system = System(SIDECAR, pd, front=pd.proxy)
        mid = (lengths.out_lo + lengths.out_hi) // 2
        for k in range(2):  # warm-up, not counted
            unloaded(system, Request(-1 - k, 0.0, lengths.median, mid), CALIBRATION_RUNG + 1)
        cal, slo, service = calibrate([system], lengths, opts.calibration_reps, opts.slo)
        rate = opts.rate or float(f"{opts.fraction / service:.3g}")
        print(slo.describe(), flush=True)
        print(f"unloaded service {1e3 * service:.0f} ms -> load {rate} req/s", flush=True)
        reqs = phase_requests(rate, opts.horizon_s(), opts.seed, lengths, opts.repeat_share)
        t["calibrated"] = time.time()
        prompts = references(pd, reqs, opts.ref_concurrency)
        t["references"] = time.time()
        print(f"{len(reqs)} requests a phase at most, {len(prompts)} references", flush=True)
        result |= {"slo": slo.as_dict(), "service_s": service, "rate": rate, "unloaded": cal}
        target = back_target(None)
        for i, name in enumerate(opts.faults):
            rec = run_phase(pd, name, i, reqs, prompts, slo, target, opts)
            phases.append(rec)
            print(_row_text(rec["row"]), flush=True)
            if name == CONTROL and rec["row"]["attainment_before"] is not None:
                target = back_target(rec["row"]["attainment_before"])
            result["target"] = target
            t[f"phase {name}"] = time.time()
            if rec.get("failed"):
                break
    except Exception as e:  # the rows so far are still worth keeping: the report says why
        result["error"] = f"{type(e).__name__}: {e}"[:1000]
        print(f"bench faults stopped: {result['error']}", flush=True)
    finally:
        result["rows"] = [p["row"] for p in phases]
        pd.close()
        result["phases_s"] = {k: round(v - t["start"], 1) for k, v in t.items()}
    return result, host_record(engines=stack_engines({SIDECAR: pd}), link=LOOPBACK)


def _row_text(r: dict[str, Any]) -> str:
    back = "-" if r["back_s"] is None else f"{r['back_s']:.1f}"
    return (
        f"{r['fault']:16} sent {r['sent']:4} errors {r['errors']:3} wrong {r['wrong']:2} "
        f"lost {r['lost']:2} changed {r['changed_bytes']} B ({r['changed_blocks']} blocks, "
        f"bound {r['alone_blocks']}) back {back} s restart {r['restart_s']} SLO met "
        f"{_share(r['attainment_before'])} / {_share(r['attainment_after'])}"
    )


def _share(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"
