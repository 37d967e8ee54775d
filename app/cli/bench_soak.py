"""``kv-sidecar bench soak``: kv-sidecar under steady load for long, its processes watched."""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path
from typing import Annotated

import typer

from app.bench.core.cores import REGIMES, binding
from app.bench.core.result_file import split_host
from app.cli.bench_load import DTYPES
from app.cli.bench_pd import bench_console, report_run
from app.errors import ConfigError

JSON_KEYS = ("holds", "rate", "requests", "errors", "ended_problems", "grew", "growth", "plot")


def soak_command(
    quick: Annotated[
        bool,
        typer.Option("--quick", help="4-layer model, prompts ~256 tokens, 90 s (30 s warm-up)."),
    ] = False,
    rate: Annotated[
        float | None,
        typer.Option(help="Requests/s (e.g. 0.8 x kv-sidecar's knee from bench load)."),
    ] = None,
    fraction: Annotated[
        float, typer.Option(help="Without --rate: this share of the unloaded service rate.")
    ] = 0.8,
    duration: Annotated[
        float | None, typer.Option(help="Seconds of arrivals (1200; --quick 90).")
    ] = None,
    warmup: Annotated[
        float | None,
        typer.Option(help="Seconds of start-up before growth counts (120; --quick 30)."),
    ] = None,
    seed: Annotated[int, typer.Option(help="Seed of arrivals and lengths.")] = 0,
    layers: Annotated[
        int | None, typer.Option(help="Model layers (default 16; 4 with --quick).")
    ] = None,
    dtype: Annotated[str, typer.Option(help="Engines' dtype, as bench load's.")] = "auto",
    regime: Annotated[str, typer.Option(help="shared or dedicated cores.")] = "shared",
    out: Annotated[Path, typer.Option(help="Folder for soak.json, soak.png and logs.")] = Path(
        "bench-soak-out"
    ),
    as_json: Annotated[bool, typer.Option("--json", help="Print the verdict as JSON.")] = False,
) -> None:
    """A soak: RSS, descriptors and threads of each sidecar and the proxy stay flat (<= +10%
    after warm-up), every request ends once on both sides. Exit status 1 when it does not hold."""
    if regime not in REGIMES:
        raise ConfigError(f"--regime {regime!r}: expected one of {', '.join(REGIMES)}")
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    if (rate is not None and rate <= 0) or not 0 < fraction <= 2:
        raise ConfigError(f"--rate {rate}, --fraction {fraction}: expected > 0 (fraction <= 2)")
    binding(regime, os.sched_getaffinity(0))  # fails here if the machine cannot
    # Heavy imports inside the command: see app/cli/main.py.
    from app.bench.core.models import QUICK_MODEL
    from app.bench.core.netns import run_child
    from app.bench.core.workload import QUICK_LENGTHS
    from app.bench.soak.bench import SoakOptions
    from app.bench.soak.report import plot, print_summary

    opts = SoakOptions(
        rate=rate,
        fraction=fraction,
        seed=seed,
        dtype=None if dtype == "auto" else dtype,
        regime=regime,
        out=str(out.resolve()),
    )
    if quick:
        opts = dataclasses.replace(
            opts,
            lengths=QUICK_LENGTHS,
            duration_s=90.0,
            warmup_s=30.0,
            drain_s=30.0,
            quick=True,
            model={**opts.model, **QUICK_MODEL},
        )
    if duration is not None:
        opts = dataclasses.replace(opts, duration_s=duration)
    if warmup is not None:
        opts = dataclasses.replace(opts, warmup_s=warmup)
    if layers is not None:
        opts = dataclasses.replace(opts, model={**opts.model, "num_hidden_layers": layers})
    # The baseline and late windows: a twentieth of the run (20-60 s), six samples each.
    base = min(60.0, max(20.0, opts.duration_s / 20))
    opts = dataclasses.replace(opts, base_s=base, every_s=base / 6)
    if opts.duration_s < opts.warmup_s + 2 * opts.base_s:
        raise ConfigError(
            f"--duration {opts.duration_s:g} s: expected at least warm-up plus two "
            f"{opts.base_s:g} s windows, the baseline and the late level "
            f"({opts.warmup_s + 2 * opts.base_s:g} s)"
        )
    console = bench_console(as_json)
    record = run_child(
        ("-m", "app.bench.soak.bench"),
        dataclasses.asdict(opts),
        out,
        "soak.json",
        regime,
        sys.stderr if as_json else None,
    )
    result, host = split_host(record)
    report_run(result, host, out / "soak", (plot, print_summary), console, as_json, JSON_KEYS)
    if not result["holds"]:
        raise typer.Exit(1)
