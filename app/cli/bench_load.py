"""``kv-sidecar bench load``: kv-sidecar against vLLM's MooncakeConnector under open-loop load."""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path
from typing import Annotated

import typer

from app.bench.core.cores import LOAD_REGIMES, binding
from app.bench.core.result_file import split_host
from app.bench.core.slo import SloFactors
from app.bench.core.stats import SYSTEMS, parse_rate, parse_size
from app.bench.core.workload import Lengths
from app.cli.bench_pd import LinkBurst, LinkRate, bench_console, report_run
from app.errors import ConfigError

DTYPES = ("auto", "float32", "bfloat16")
LOAD_LINKS = ("unshaped", "shaped")
JSON_KEYS = (
    "summary",
    "link",
    "slo",
    "rates",
    "service_s",
    "aa_rate",
    "engine_dtype",
    "phases_s",
    "plot",
    "binding",
)


def _fractions(text: str) -> tuple[float, ...]:
    try:
        out = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError as e:
        raise ConfigError(f"--fractions {text!r}: expected numbers such as 0.5,1,2") from e
    if not out or min(out) <= 0:
        raise ConfigError("--fractions: at least one, every one > 0")
    return out


TtftFactor = Annotated[
    float, typer.Option(help="SLO: TTFT <= this x unloaded prefill(prompt) + 100 ms.")
]
TpotFactor = Annotated[float, typer.Option(help="SLO: TPOT <= this x the unloaded TPOT.")]


def load_command(
    quick: Annotated[
        bool,
        typer.Option(
            "--quick",
            help="4-layer model, prompts ~256 tokens (64-1k), 3 rates of 4 s.",
        ),
    ] = False,
    fractions: Annotated[
        str,
        typer.Option(help="Rates, as multiples of 1 / the unloaded service time, comma-separated."),
    ] = "0.25,0.5,0.75,1,1.5,2",
    duration: Annotated[float, typer.Option(help="Seconds of arrivals per rate step.")] = 60.0,
    min_requests: Annotated[int, typer.Option(help="At least this many requests a step.")] = 8,
    reps: Annotated[int, typer.Option(help="Passes over the ladder (min–max over them).")] = 1,
    seed: Annotated[int, typer.Option(help="Seed of arrivals and lengths.")] = 0,
    prompt_median: Annotated[int, typer.Option(help="Median prompt tokens (lognormal).")] = 1024,
    prompt_max: Annotated[int, typer.Option(help="Longest prompt (clip), tokens.")] = 8192,
    layers: Annotated[
        int | None, typer.Option(help="Model layers (default 16; 4 with --quick).")
    ] = None,
    dtype: Annotated[
        str, typer.Option(help="Engines' dtype: auto (float32 where bf16 is emulated), ...")
    ] = "auto",
    regime: Annotated[
        str,
        typer.Option(
            help="shared or dedicated cores, as bench pd's --regime; or split: prefill's "
            "forward on core 0, decode's on core 1, the rest on all cores."
        ),
    ] = "shared",
    link: Annotated[
        str,
        typer.Option(
            help="unshaped, or shaped: loopback shaped for the rate steps (after the unloaded "
            "run), as bench pd's --link shaped."
        ),
    ] = "unshaped",
    rate: LinkRate = None,
    burst: LinkBurst = None,
    aa: Annotated[
        str, typer.Option(help="Measure this system twice at the middle rate (A/A), or 'none'.")
    ] = SYSTEMS[0],
    out: Annotated[Path, typer.Option(help="Folder for load.json, load.png and logs.")] = Path(
        "bench-load-out"
    ),
    ttft_factor: TtftFactor = 2.0,
    tpot_factor: TpotFactor = 1.5,
    as_json: Annotated[bool, typer.Option("--json", help="Print the summary as JSON.")] = False,
) -> None:
    """Open-loop load: TTFT/TPOT percentiles, goodput at an SLO and the knee, per system."""
    if aa not in (*SYSTEMS, "none"):
        raise ConfigError(f"--aa {aa!r}: expected one of {', '.join(SYSTEMS)} or none")
    if regime not in LOAD_REGIMES:
        raise ConfigError(f"--regime {regime!r}: expected one of {', '.join(LOAD_REGIMES)}")
    if link not in LOAD_LINKS:
        raise ConfigError(f"--link {link!r}: expected one of {', '.join(LOAD_LINKS)}")
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    if reps < 1 or duration <= 0 or min_requests < 1:
        raise ConfigError("--reps, --duration and --min-requests must be positive")
    bound = binding(regime, os.sched_getaffinity(0))  # fails here if the machine cannot
    # Heavy imports inside the command: see app/cli/main.py.
    from app.bench.core.models import QUICK_MODEL
    from app.bench.core.netns import run_child
    from app.bench.core.workload import QUICK_LENGTHS
    from app.bench.load.bench import LoadOptions
    from app.bench.load.report import plot, print_summary

    base = Lengths()
    median = min(prompt_median, prompt_max)
    opts = LoadOptions(
        lengths=dataclasses.replace(base, median=median, hi=prompt_max, lo=min(base.lo, median)),
        fractions=_fractions(fractions),
        duration_s=duration,
        min_requests=min_requests,
        reps=reps,
        seed=seed,
        aa=None if aa == "none" else aa,
        dtype=None if dtype == "auto" else dtype,
        out=str(out.resolve()),
        regime=regime,
        link=link,
        rate_bps=parse_rate(rate) if rate else None,
        burst=parse_size(burst) if burst else None,
        slo=SloFactors(ttft=ttft_factor, tpot=tpot_factor),
    )
    if quick:
        opts = dataclasses.replace(
            opts,
            lengths=QUICK_LENGTHS,
            fractions=(0.25, 0.5, 1.0),
            duration_s=4.0,
            min_requests=3,
            warmup=1,
            calibration_reps=1,
            drain_s=20.0,
            quick=True,
            model={**opts.model, **QUICK_MODEL},
        )
    if layers is not None:
        opts = dataclasses.replace(opts, model={**opts.model, "num_hidden_layers": layers})
    console = bench_console(as_json)
    console.print(bound.describe())
    child = ("-m", "app.bench.load.bench")
    # With --json the run's progress goes to stderr: stdout is the JSON alone.
    record = run_child(
        child, dataclasses.asdict(opts), out, "load.json", regime, sys.stderr if as_json else None
    )
    result, host = split_host(record)
    report_run(result, host, out / "load", (plot, print_summary), console, as_json, JSON_KEYS)
