"""``kv-sidecar bench faults``: one part of a kv-sidecar P/D pair killed under load, in turn."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Annotated

import typer

from app.bench.core.slo import SloFactors
from app.cli.bench_load import TpotFactor, TtftFactor
from app.cli.bench_pd import bench_console, report_run
from app.errors import ConfigError

JSON_KEYS = ("rows", "slo", "rate", "service_s", "target", "phases_s", "plot")


def faults_command(
    quick: Annotated[
        bool,
        typer.Option(
            "--quick",
            help="Shorter phases (5 s before the kill, 20 s control), prompts ~256 tokens, "
            "no engine restarts: the sidecars and the master.",
        ),
    ] = False,
    faults: Annotated[
        str | None,
        typer.Option(
            help="Comma-separated, in order, of none (the control phase: nothing killed), "
            "prefill-vllm, decode-vllm, prefill-sidecar, decode-sidecar, master. Default: all.",
        ),
    ] = None,
    fraction: Annotated[
        float, typer.Option(help="Load, as a share of the unloaded service rate.")
    ] = 0.7,
    rate: Annotated[
        float | None,
        typer.Option(help="Load in requests/s instead (the calibration's noise cannot move it)."),
    ] = None,
    seed: Annotated[int, typer.Option(help="Seed of arrivals, lengths and repeats.")] = 0,
    out: Annotated[Path, typer.Option(help="Folder for faults.json, faults.png and logs.")] = Path(
        "bench-faults-out"
    ),
    ttft_factor: TtftFactor = 2.0,
    tpot_factor: TpotFactor = 1.5,
    as_json: Annotated[bool, typer.Option("--json", help="Print the rows as JSON.")] = False,
) -> None:
    """Faults under load: errors, wrong answers, lost requests, stray bytes, recovery time."""
    if not 0 < fraction <= 2 or (rate is not None and rate <= 0):
        raise ConfigError(
            f"--fraction {fraction}, --rate {rate}: expected 0 < fraction <= 2, rate > 0"
        )
    # Heavy imports inside the command: see app/cli/main.py.
    from app.bench.faults.bench import run
    from app.bench.faults.plan import (
        CONTROL,
        QUICK_FAULTS,
        QUICK_LENGTHS,
        FaultOptions,
        parse_faults,
    )
    from app.bench.faults.report import plot, print_summary

    opts = FaultOptions(
        fraction=fraction,
        rate=rate,
        seed=seed,
        out=str(out.resolve()),
        slo=SloFactors(ttft=ttft_factor, tpot=tpot_factor),
    )
    if quick:
        opts = dataclasses.replace(
            opts,
            faults=(CONTROL, *QUICK_FAULTS),
            lengths=QUICK_LENGTHS,
            pre_s=5.0,
            control_s=20.0,
            after_s=40.0,
            engine_after_s=100.0,
            window=6,
            hold_s=5.0,
            drain_s=30.0,
            calibration_reps=1,
            quick=True,
        )
    if faults is not None:
        opts = dataclasses.replace(opts, faults=parse_faults(faults))
    console = bench_console(as_json)
    out.mkdir(parents=True, exist_ok=True)
    from app.bench.core.stop_signals import exit_on_signal

    exit_on_signal()
    result, host = run(opts)
    for key in JSON_KEYS:  # a run stopped early lacks some
        result.setdefault(key, None)
    report_run(result, host, out / "faults", (plot, print_summary), console, as_json, JSON_KEYS)
