"""``bench load``'s run, inside the network namespace: both systems under open-loop load.

``python -m app.bench.load.bench OPTIONS.json`` is what ``core.netns.run_child`` runs; it writes
``load.json`` to the output folder. The same systems, engines, regimes, taps and records as
``bench pd`` (``core.systems``, ``core.cores``, ``core.observe``). In order: warm-up (not counted);
the unloaded run (calibration lengths one at a time, on each system), which gives the SLO and
the service time the ladder of rates is made from; then per rate, the same seeded request
sequence on each system, which goes first alternating rate by rate; at one rate kv-sidecar runs
it a second time (``kv-sidecar-aa``: the A/A noise floor).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from app.bench.core.calibrate import CALIBRATION_RUNG, calibrate, set_up
from app.bench.core.cores import place_threads, placement_text
from app.bench.core.host import HostRecord, host_record, links_text, stack_engines
from app.bench.core.interleave import aa_name
from app.bench.core.link import calibration_text, set_link
from app.bench.core.models import FULL_MODEL
from app.bench.core.netns import child_main
from app.bench.core.slo import Slo, SloFactors
from app.bench.core.stats import SIDECAR, SYSTEMS
from app.bench.core.step import run_step, unloaded, wait_idle
from app.bench.core.systems import CPU_SCOPE, System, start_systems, stop_systems
from app.bench.core.target_path import STAGES
from app.bench.core.workload import Lengths, Request, ladder, schedule
from app.bench.load.stats import handoff_ms, link_calibration, step_figures, summarize_steps


@dataclass(frozen=True)
class LoadOptions:
    lengths: Lengths = field(default_factory=Lengths)
    fractions: tuple[float, ...] = (0.25, 0.5, 0.75, 1.0, 1.5, 2.0)  # of the unloaded rate
    duration_s: float = 60.0  # arrivals per rate step
    min_requests: int = 8
    reps: int = 1
    seed: int = 0
    warmup: int = 2  # requests per system, not counted
    calibration_reps: int = 2  # of each calibration length, per system
    drain_s: float = 120.0  # after the last send; still running then: cancelled, not good
    request_timeout_s: float = 600.0
    sample_s: float = 0.5  # vLLM gauges' sampling period during a step
    aa: str | None = SIDECAR
    aa_rung: int | None = None  # which rate (index) A/A runs at; None: the middle one
    dtype: str | None = None  # vLLM --dtype; None: chosen by the CPU's flags
    quick: bool = False
    out: str = "bench-load-out"
    model: dict[str, Any] = field(default_factory=lambda: dict(FULL_MODEL))
    regime: str = "shared"
    link: str = "unshaped"  # unshaped | shaped: loopback shaped after the unloaded run
    rate_bps: float | None = None  # shaped; None: calibrated (core.stats.calibrate_link's rule)
    burst: int | None = None
    slo: SloFactors = field(default_factory=SloFactors)

    @classmethod
    def from_json(cls, text: str) -> LoadOptions:
        d = json.loads(text)
        d["lengths"] = Lengths(**d["lengths"])
        d["slo"] = SloFactors(**d.get("slo", {}))
        d["fractions"] = tuple(d["fractions"])
        return cls(**d)


def step_record(
    opts: LoadOptions, system: System, rate: float, rung: int, rep: int, slo: Slo, requests: Any
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
    rec = {"rate": rate, "rung": rung, "rep": rep, "system": system.name}
    rec |= figs | {k: v for k, v in obs.items() if k != "samples"} | flat
    print(_step_text(rec), flush=True)
    return rec | {"samples": obs["samples"], "requests": answers}


def _step_text(r: dict[str, Any]) -> str:
    def f(v: float | None, fmt: str = ".0f") -> str:
        return "-" if v is None else format(v, fmt)

    return (
        f"rate {r['rate']:.3g}/s rep {r['rep']} {r['system']:14} n {r['n_requests']:3} "
        f"TTFT p50/p90/p99 {f(r['ttft_p50_ms'])}/{f(r['ttft_p90_ms'])}/{f(r['ttft_p99_ms'])} ms "
        f"(handoff {f(r['handoff_ms'])} ms; after P p50/p99 {f(r['after_p_p50_ms'])}/"
        f"{f(r['after_p_p99_ms'])} ms) TPOT p50/p90 {f(r['tpot_p50_ms'], '.1f')}/"
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


def rung_order(names: list[str], rung: int, rep: int) -> list[str]:
    # Which system goes first alternates rate by rate (and rep by rep).
    k = (rung + rep) % len(names)
    return names[k:] + names[:k]


def run(opts: LoadOptions) -> tuple[dict[str, Any], HostRecord]:
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
        aa_rung = (len(rates) // 2 if opts.aa_rung is None else opts.aa_rung) if opts.aa else None
        by_name = {s.name: s for s in systems}
        if opts.aa is not None:
            by_name[aa_name(opts.aa)] = by_name[opts.aa].twin(aa_name(opts.aa))
        steps = []
        for rep in range(opts.reps):
            for rung, rate in enumerate(rates):
                # One seed for every rung: the same requests, closer together (schedule).
                reqs = schedule(rate, opts.duration_s, opts.seed, lengths, opts.min_requests)
                names = [s.name for s in systems]
                if rung == aa_rung and opts.aa is not None:
                    names.append(aa_name(opts.aa))
                for name in rung_order(names, rung, rep):
                    wait_idle(by_name[name])
                    steps.append(step_record(opts, by_name[name], rate, rung, rep, slo, reqs))
        phases["steps_done"] = time.time()
        aa = (opts.aa, aa_name(opts.aa)) if opts.aa is not None else None
        summary = summarize_steps(steps, SYSTEMS, aa)
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
            "aa_rate": rates[aa_rung] if aa_rung is not None else None,
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
