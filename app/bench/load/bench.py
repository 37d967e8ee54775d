"""``bench load``'s run, inside the network namespace: both systems under open-loop load.

``python -m app.bench.load.bench OPTIONS.json`` is what ``core.netns.run_child`` runs; it writes
``load.json`` to the output folder. The same systems, engines, regimes, taps and records as
``bench pd`` (``core.systems``, ``core.cores``, ``core.observe``). In order: warm-up (not counted);
the unloaded run (calibration lengths one at a time, on each system), which gives the SLO and
the service time the ladder of rates is made from; then per rate, the same seeded requests on
each system in ``rounds`` interleaved blocks (ABBA, ``core.interleave``; which system opens
alternates rate by rate): ``requests`` a system a rate, over its rounds. Two rounds of one
system are its A/A; their drift is printed; the ratios come with bootstrap intervals
(``load.compare``).
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from app.bench.core.calibrate import CALIBRATION_RUNG, calibrate, set_up
from app.bench.core.cores import place_threads, placement_text
from app.bench.core.host import HostRecord, host_record, links_text, stack_engines
from app.bench.core.interleave import MIN_ROUNDS, Block, abba
from app.bench.core.link import calibration_text, set_link
from app.bench.core.models import FULL_MODEL
from app.bench.core.netns import child_main
from app.bench.core.slo import Slo, SloFactors, named_tail
from app.bench.core.stats import SYSTEMS
from app.bench.core.step import run_step, unloaded, wait_idle
from app.bench.core.systems import CPU_SCOPE, System, start_systems, stop_systems
from app.bench.core.target_path import STAGES
from app.bench.core.workload import Lengths, Request, ladder, schedule
from app.bench.load.compare import compare
from app.bench.load.stats import handoff_ms, link_calibration, step_figures, summarize_steps
from app.errors import ConfigError


@dataclass(frozen=True)
class LoadOptions:
    lengths: Lengths = field(default_factory=Lengths)
    # Of the unloaded rate. No 0.25: its 40 requests a system would take 160 service times, a
    # third of the hour, at a load where neither system misses.
    fractions: tuple[float, ...] = (0.5, 0.75, 1.0, 1.5, 2.0)
    # Per system and rate, over its rounds: 40 gives a P90 over 4 requests past it, and
    # (with 5 rates, 4 layers, prompts ~1k) a run within the hour on 2 cores.
    requests: int = 40
    rounds: int = 2  # interleaved ABBA blocks per rate (at least 2: the A/A)
    seed: int = 0
    warmup: int = 2  # requests per system, not counted
    calibration_reps: int = 2  # of each calibration length, per system
    drain_s: float = 120.0  # after the last send; still running then: cancelled, not good
    request_timeout_s: float = 600.0
    sample_s: float = 0.5  # vLLM gauges' sampling period during a step
    dtype: str | None = None  # vLLM --dtype; None: chosen by the CPU's flags
    quick: bool = False
    out: str = "bench-load-out"
    model: dict[str, Any] = field(default_factory=lambda: dict(FULL_MODEL))
    regime: str = "shared"
    link: str = "unshaped"  # unshaped | shaped: loopback shaped after the unloaded run
    rate_bps: float | None = None  # shaped; None: calibrated (core.stats.calibrate_link's rule)
    burst: int | None = None
    slo: SloFactors = field(default_factory=SloFactors)

    def check(self) -> None:
        if self.rounds < MIN_ROUNDS or self.requests < self.rounds:
            raise ConfigError(
                f"rounds {self.rounds}, requests {self.requests}: expected at least "
                f"{MIN_ROUNDS} rounds (the A/A) and a request a round"
            )

    @property
    def per_round(self) -> int:
        return math.ceil(self.requests / self.rounds)

    @classmethod
    def from_json(cls, text: str) -> LoadOptions:
        d = json.loads(text)
        d["lengths"] = Lengths(**d["lengths"])
        d["slo"] = SloFactors(**d.get("slo", {}))
        d["fractions"] = tuple(d["fractions"])
        return cls(**d)


def step_record(
    opts: LoadOptions, system: System, rate: float, rung: int, round_: int, slo: Slo, requests: Any
) -> dict[str, Any]:
    obs = run_step(system, requests, rung, opts.drain_s, opts.sample_s, opts.request_timeout_s)
    figs = step_figures(obs["answers"], slo)
    flat = {
        "d_kv_usage_max": obs["d_kv_usage"]["max"],
        "d_waiting_max": obs["d_waiting"]["max"],
        "handoff_ms": handoff_ms(figs["ttft_mean_ms"], obs["p_prefill_ms"]),
    }
    answers = [
        {k: v for k, v in a.items() if k != "tokens"} | {"tokens": len(a.get("tokens") or ())}
        for a in obs.pop("answers")
    ]
    # "rep": the round, under the name older runs' readers know.
    rec = {"rate": rate, "rung": rung, "rep": round_, "round": round_, "system": system.name}
    rec |= figs | {k: v for k, v in obs.items() if k != "samples"} | flat
    print(_step_text(rec), flush=True)
    return rec | {"samples": obs["samples"], "requests": answers}


def _step_text(r: dict[str, Any]) -> str:
    def f(v: float | None, fmt: str = ".0f") -> str:
        return "-" if v is None else format(v, fmt)

    t_name, t_ms = named_tail(r["ttft_p99_ms"], r["ttft_max_ms"])
    a_name, a_ms = named_tail(r["after_p_p99_ms"], r["after_p_max_ms"])
    return (
        f"rate {r['rate']:.3g}/s round {r['round'] + 1} {r['system']:14} n {r['n_requests']:3} "
        f"TTFT p50/p90/{t_name} {f(r['ttft_p50_ms'])}/{f(r['ttft_p90_ms'])}/{f(t_ms)} ms "
        f"(handoff {f(r['handoff_ms'])} ms; after P p50/{a_name} {f(r['after_p_p50_ms'])}/"
        f"{f(a_ms)} ms) TPOT p50/p90 {f(r['tpot_p50_ms'], '.1f')}/"
        f"{f(r['tpot_p90_ms'], '.1f')} ms  thr {r['throughput_rps']:.2f}/s good "
        f"{r['goodput_rps']:.2f}/s ({100 * r['attainment']:.0f}%)  D KV max "
        f"{f(r['d_kv_usage_max'], '.2f')} waiting max {f(r['d_waiting_max'])} "
        f"preempt {f(r['preemptions'])} recomputed {f(r['failed_loads_est'])} "
        f"cpu {r['transfer_cpu_ms']:.0f} ms{_target_text(r.get('target_path'))}"
    )


def _target_text(path: dict[str, Any] | None) -> str:
    if not path or not path["n"]:
        return ""
    p50 = {k: path[k]["p50"] for k in STAGES}
    return "  to target p50: " + ", ".join(
        f"{k.removesuffix('_ms')} {'-' if v is None else f'{v:.0f}'} ms" for k, v in p50.items()
    )


def shape(
    opts: LoadOptions, unloaded_rows: list[dict[str, Any]]
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The link the rate steps run on: loopback as it is, or shaped to ``opts.rate_bps`` or, by
    default, to the rate at which a request's KV takes ~25% of P's prefill (``bench pd``'s
    rule, from the unloaded run). The SLO came from that unshaped run: it does not move with
    the link. The link's settings and the calibration (None when not calibrated)."""
    if opts.link == "unshaped":
        return {"link": "unshaped"}, None
    if opts.rate_bps is not None:
        return set_link(opts.rate_bps, opts.burst), None
    cal = link_calibration(unloaded_rows)
    print(calibration_text(cal), flush=True)
    return set_link(cal["rate_bps"], opts.burst), cal


def rung_requests(rate: float, n: int, seed: int, lengths: Lengths) -> tuple[Request, ...]:
    """A round's ``n`` requests at ``rate``: one seed for every rung, so the same requests
    (index i the same lengths everywhere), closer together (``schedule``); cut at ``n``, as
    ``schedule``'s duration (1 s here) only ever adds to it."""
    return schedule(rate, 1.0, seed, lengths, n)[:n]


# A step's own cost past its requests (waiting for idle engines, reading the gauges and the
# transfer records): ~4.6 s a step in a --quick run on the loaded 2-core host.
STEP_OVERHEAD_S = 5.0


def estimate_s(
    service_s: float, rates: Sequence[float], requests: int, systems: int, rounds: int = 2
) -> float:
    """The rate steps' wall time, roughly: at a rate below the unloaded service rate the
    arrivals' span, above it no faster than one request a service time (batching does better;
    the drain is bounded apart), and each step's overhead. Measured: the unloaded service
    time."""
    per = sum(requests * max(1 / r, service_s) for r in rates)
    return systems * (per + len(rates) * rounds * STEP_OVERHEAD_S)


def estimate_text(service_s: float, rates: Sequence[float], opts: LoadOptions, n: int) -> str:
    est = estimate_s(service_s, rates, opts.requests, n, opts.rounds)
    return (
        f"{opts.requests} requests a system a rate in {opts.rounds} rounds: the rate steps "
        f"should take about {est:.0f} s ({est / 60:.0f} min; from the unloaded service time)"
    )


def run_order(names: list[str], rungs: int, rounds: int) -> list[tuple[int, Block]]:
    """The rate steps in run order: rung by rung, each in ABBA blocks of ``rounds`` rounds
    (``core.interleave``), the opening system alternating rung by rung."""
    return [(rung, b) for rung in range(rungs) for b in abba(rung_order(names, rung, 0), rounds)]


def rung_order(names: list[str], rung: int, rep: int) -> list[str]:
    # Which system goes first alternates rate by rate (and rep by rep).
    k = (rung + rep) % len(names)
    return names[k:] + names[:k]


def run(opts: LoadOptions) -> tuple[dict[str, Any], HostRecord]:
    opts.check()
    out = Path(opts.out)
    work = out / "work"
    setup = set_up(opts.regime, opts.dtype, opts.lengths, opts.model, work)
    b, dtype, lengths, model = setup.binding, setup.dtype, setup.lengths, setup.model
    phases = {"start": time.time()}  # where a run's wall time goes (engine start: most)
    systems = start_systems(model, work, lengths.longest + 64, dtype.dtype, role_env=b.role_env())
    phases["engines_up"] = time.time()
    try:
        groups = {"bench client": [os.getpid()]}
        for s in systems:
            groups |= s.process_groups()
        print(placement_text(place_threads(groups, b)), flush=True)
        mid = (lengths.out_lo + lengths.out_hi) // 2
        warm = [
            unloaded(s, Request(-1 - k, 0.0, lengths.median, mid), CALIBRATION_RUNG + 1)
            for k in range(opts.warmup)
            for s in systems
        ]
        placement = place_threads(groups, b)  # threads started on the first requests
        cal, slo, service = calibrate(systems, lengths, opts.calibration_reps, opts.slo)
        rates = ladder(service, opts.fractions)
        link, link_cal = shape(opts, cal)
        phases["calibrated"] = time.time()
        print(slo.describe(), flush=True)
        print(
            f"unloaded service time {1e3 * service:.0f} ms -> rates "
            + ", ".join(f"{r:.3g}" for r in rates)
            + " req/s",
            flush=True,
        )
        print(estimate_text(service, rates, opts, len(systems)), flush=True)
        by_name = {s.name: s for s in systems}
        steps = []
        for rung, block in run_order([s.name for s in systems], len(rates), opts.rounds):
            rate = rates[rung]
            reqs = rung_requests(rate, opts.per_round, opts.seed, lengths)
            wait_idle(by_name[block.system])
            steps.append(
                step_record(opts, by_name[block.system], rate, rung, block.round, slo, reqs)
            )
        phases["steps_done"] = time.time()
        summary = summarize_steps(steps, SYSTEMS)
        rounds = compare(steps, SYSTEMS, slo, opts.seed)
        # The knees from the requests pooled over the rounds, not a median of the rounds'.
        ratio = rounds["knee_ratio"]
        summary |= {"knee": rounds["knee"], "knee_ratio": ratio and ratio["point"]}
        summary["rounds"] = rounds
        engines = stack_engines({s.name: s.pd for s in systems})
        host = host_record(engines=engines, link=links_text([link]))
        return {
            "options": asdict(opts),
            "binding": b.as_dict() | {"placement": placement},
            "engine_dtype": dtype.as_dict(),
            "lengths": asdict(lengths),
            "unloaded": cal,
            "warmup": warm,
            "service_s": service,
            "rates": list(rates),
            "link": link,
            "link_calibration": link_cal,
            "slo": slo.as_dict(),
            "cpu_scope": CPU_SCOPE,
            "steps": steps,
            "summary": summary,
            "logs": str(work),
            "phases_s": {k: round(v - phases["start"], 1) for k, v in phases.items()},
        }, host
    finally:
        stop_systems(systems)


def main(argv: list[str] | None = None) -> None:
    child_main(argv, LoadOptions.from_json, run, "load.json")


if __name__ == "__main__":
    main()
