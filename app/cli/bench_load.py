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
from app.bench.core.stats import parse_rate, parse_size
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
            help="4-layer model of hidden 512, prompts ~256 tokens (64-1k), 3 rates, "
            "6 requests a system a rate.",
        ),
    ] = False,
    fractions: Annotated[
        str,
        typer.Option(help="Rates, as multiples of 1 / the unloaded service time, comma-separated."),
    ] = "0.5,0.75,1,1.5,2",
    requests: Annotated[
        int, typer.Option(help="Requests a system sends at each rate, over its rounds.")
    ] = 40,
    rounds: Annotated[
        int,
        typer.Option(
            help="Interleaved rounds (ABBA blocks) per rate; two rounds of a system: its A/A."
        ),
    ] = 2,
    seed: Annotated[int, typer.Option(help="Seed of arrivals and lengths.")] = 0,
    prompt_median: Annotated[int, typer.Option(help="Median prompt tokens (lognormal).")] = 1024,
    prompt_max: Annotated[int, typer.Option(help="Longest prompt (clip), tokens.")] = 8192,
    layers: Annotated[
        int, typer.Option(help="Model layers (4: a default run within the hour on 2 cores).")
    ] = 4,
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
    out: Annotated[Path, typer.Option(help="Folder for load.json, load.png and logs.")] = Path(
        "bench-load-out"
    ),
    ttft_factor: TtftFactor = 2.0,
    tpot_factor: TpotFactor = 1.5,
    as_json: Annotated[bool, typer.Option("--json", help="Print the summary as JSON.")] = False,
) -> None:
    """Open-loop load: TTFT/TPOT percentiles, goodput at an SLO and the knee, per system."""
    if regime not in LOAD_REGIMES:
        raise ConfigError(f"--regime {regime!r}: expected one of {', '.join(LOAD_REGIMES)}")
    if link not in LOAD_LINKS:
        raise ConfigError(f"--link {link!r}: expected one of {', '.join(LOAD_LINKS)}")
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    if rounds < 2 or requests < rounds:
        raise ConfigError(
            f"--rounds {rounds}, --requests {requests}: expected at least 2 rounds (the A/A) "
            "and a request a round"
        )
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
        requests=requests,
        rounds=rounds,
        seed=seed,
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
            requests=6,
            warmup=1,
            calibration_reps=1,
            drain_s=20.0,
            quick=True,
            model={**opts.model, **QUICK_MODEL},
        )
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
