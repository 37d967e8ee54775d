"""``bench soak``'s run, inside the network namespace: kv-sidecar under a steady open-loop load
for a long time, its transfer path's processes watched.

``python -m app.bench.soak.bench OPTIONS.json`` is what ``core.netns.run_child`` runs; it writes
``soak.json`` to the output folder. The same system, engines and regimes as ``bench load``
(``core.systems``, ``core.cores``). In order: warm-up requests; the rate (given, or a share of the
unloaded service rate measured here); one seeded Poisson sequence for the whole duration, while
each sidecar's and the proxy's RSS, open descriptors and threads are sampled; then the drain,
and the sidecars' and the proxy's counters against the number of requests.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from app.bench.core.calibrate import CALIBRATION_RUNG, calibrate, set_up
from app.bench.core.cores import descendants, place_threads, placement_text, proc_usage
from app.bench.core.host import LOOPBACK, HostRecord, host_record, stack_engines
from app.bench.core.models import FULL_MODEL
from app.bench.core.netns import child_main
from app.bench.core.slo import percentile, timings
from app.bench.core.stats import SIDECAR
from app.bench.core.step import fire, unloaded, wait_idle
from app.bench.core.systems import SIDECAR_PROCESSES, System, start_systems, stop_systems
from app.bench.core.workload import Lengths, Request, schedule
from app.bench.soak.stats import delta, ended_once, grew, growth, labelled

SOAK_RUNG = 500  # prompts distinct from bench load's rungs and calibration
WATCHED = (*SIDECAR_PROCESSES, "proxy")


@dataclass(frozen=True)
class SoakOptions:
    lengths: Lengths = field(default_factory=Lengths)
    rate: float | None = None  # requests/s; None: ``fraction`` x the unloaded service rate
    fraction: float = 0.8
    duration_s: float = 1200.0
    warmup_s: float = 120.0  # usage before this is start-up, not growth
    base_s: float = 60.0  # the baseline: the median of the samples in this long after warm-up
    every_s: float = 10.0  # usage sampling period
    seed: int = 0
    drain_s: float = 120.0
    request_timeout_s: float = 600.0
    dtype: str | None = None
    regime: str = "shared"
    quick: bool = False
    out: str = "bench-soak-out"
    model: dict[str, Any] = field(default_factory=lambda: dict(FULL_MODEL))

    @classmethod
    def from_json(cls, text: str) -> SoakOptions:
        d = json.loads(text)
        d["lengths"] = Lengths(**d["lengths"])
        return cls(**d)


class UsageSampler(threading.Thread):
    """Every ``every_s``, each watched process tree's usage (re-listed each time: a sidecar's
    children may come and go), stamped with seconds from ``t0``."""

    def __init__(self, system: System, t0: float, every_s: float) -> None:
        super().__init__(name="soak-usage", daemon=True)
        self.roots = {n: system.pd.procs[n].pid for n in WATCHED}
        self.t0, self.every_s = t0, every_s
        self.samples: list[dict[str, Any]] = []
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.is_set():
            usage = {}
            for name, pid in self.roots.items():
                others = [p for n, p in self.roots.items() if n != name]
                usage[name] = proc_usage(descendants([pid], stop=others))
            self.samples.append({"t": round(time.time() - self.t0, 1), "usage": usage})
            self.stopping.wait(self.every_s)


def _counters(system: System) -> dict[str, dict[str, float]]:
    get = lambda url: httpx.get(f"{url}/metrics", timeout=10).text  # noqa: E731
    p, d, proxy = get(system.pd.prefill.admin), get(system.pd.decode.admin), get(system.front)
    return {
        "p_ended": labelled(p, "kvsidecar_requests"),
        "d_ended": labelled(d, "kvsidecar_requests"),
        "p_live": labelled(p, "kvsidecar_requests_in_flight"),
        "d_live": labelled(d, "kvsidecar_requests_in_flight"),
        "proxy": labelled(proxy, "kvproxy_requests"),
        "transfers": labelled(proxy, "kvproxy_transfers"),
    }


def windows(answers: list[dict[str, Any]], t0: float, width_s: float) -> list[dict[str, Any]]:
    """TTFT P50/P90 per ``width_s`` window of send time: latency must not drift either."""
    by: dict[int, list[float]] = {}
    for a in answers:
        ttft = timings(a)["ttft_s"]
        if a.get("error") is None and ttft is not None:
            by.setdefault(int((a["sent"] - t0) // width_s), []).append(1e3 * ttft)
    return [
        {"from_s": k * width_s, "n": len(v), "ttft_p50_ms": percentile(v, 50),
         "ttft_p90_ms": percentile(v, 90)}
        for k, v in sorted(by.items())
    ]  # fmt: skip


def run(opts: SoakOptions) -> tuple[dict[str, Any], HostRecord]:
    """The whole soak (module docstring); the JSON ``soak.json`` holds."""
    work = Path(opts.out) / "work"
    setup = set_up(opts.regime, opts.dtype, opts.lengths, opts.model, work)
    b, dtype, lengths, model = setup.binding, setup.dtype, setup.lengths, setup.model
    (system,) = start_systems(model, work, lengths.longest + 64, dtype.dtype, names=(SIDECAR,))
    try:
        groups = {"bench client": [os.getpid()], **system.process_groups()}
        mid = (lengths.out_lo + lengths.out_hi) // 2
        for k in range(2):
            unloaded(system, Request(-1 - k, 0.0, lengths.median, mid), CALIBRATION_RUNG + 1)
        print(placement_text(place_threads(groups, b)), flush=True)
        service = None
        rate = opts.rate
        if rate is None:
            _, _, service = calibrate([system], lengths, 1)
            rate = float(f"{opts.fraction / service:.3g}")
        print(f"soak: {rate} req/s for {opts.duration_s:g} s", flush=True)
        reqs = schedule(rate, opts.duration_s, opts.seed, lengths)
        before = _counters(system)
        t0 = time.time()
        sampler = UsageSampler(system, t0, opts.every_s)
        sampler.start()
        answers, gauges = asyncio.run(
            fire(system, reqs, SOAK_RUNG, opts.drain_s, 5.0, opts.request_timeout_s)
        )
        idle = wait_idle(system)
        time.sleep(2.0)  # the sidecars' last records end after the client's answer
        sampler.stopping.set()
        sampler.join()
        after = _counters(system)
        host = host_record(engines=stack_engines({system.name: system.pd}), link=LOOPBACK)
        return _result(opts, reqs, answers, gauges, sampler.samples, before, after) | {
            "options": asdict(opts),
            "binding": b.as_dict(),
            "engine_dtype": dtype.as_dict(),
            "lengths": asdict(lengths),
            "service_s": service,
            "rate": rate,
            "idle_after": idle,
            "t0": t0,
            "logs": str(work),
        }, host
    finally:
        stop_systems([system])


def _result(
    opts: SoakOptions,
    reqs: tuple[Request, ...],
    answers: list[dict[str, Any]],
    gauges: list[dict[str, Any]],
    samples: list[dict[str, Any]],
    before: dict[str, dict[str, float]],
    after: dict[str, dict[str, float]],
) -> dict[str, Any]:
    errors = [a for a in answers if a.get("error") is not None]
    # Fewer tokens than asked is the model's end of sequence (a broken stream is an error).
    eos = [a for a in answers if a.get("error") is None and len(a["tokens"]) < a["max_tokens"]]
    proxy = delta(before["proxy"], after["proxy"])
    transfers = delta(before["transfers"], after["transfers"])
    moved = round(sum(v for k, v in proxy.items() if "decision=disaggregated" in k))
    problems = ended_once(
        delta(before["p_ended"], after["p_ended"]),
        delta(before["d_ended"], after["d_ended"]),
        after["p_live"],
        after["d_live"],
        transfers,
    )
    if round(sum(transfers.values())) != moved:
        problems.append(f"the proxy ended {sum(transfers.values()):g} transfers of {moved}")
    figures = growth(samples, opts.warmup_s, opts.base_s, opts.duration_s)
    over = grew(figures)
    t0 = min(a["sent"] for a in answers)
    d_kv = [g["d_kv_cache_usage_perc"] for g in gauges if "d_kv_cache_usage_perc" in g]
    return {
        "requests": len(reqs),
        "errors": len(errors),
        "error_examples": sorted({str(a["error"])[:200] for a in errors})[:5],
        "ended_at_eos": len(eos),
        "disaggregated": moved,
        "proxy_requests": proxy,
        "proxy_transfers": transfers,
        "ended_problems": problems,
        "growth": figures,
        "grew": over,
        "usage": samples,
        "windows": windows(answers, t0, 60.0),
        "d_kv_usage_mean": statistics.fmean(d_kv) if d_kv else None,
        "holds": not errors and not problems and not over,
    }


def main(argv: list[str] | None = None) -> None:
    child_main(argv, SoakOptions.from_json, run, "soak.json")


if __name__ == "__main__":
    main()
