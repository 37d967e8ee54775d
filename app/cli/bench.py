"""``kv-sidecar bench``: goodput, overlap, descriptors, planning cost and scale in one run."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from app.cli.bench_chat_keys import chat_keys_command
from app.cli.bench_faults import faults_command
from app.cli.bench_load import load_command
from app.cli.bench_pd import pd_command
from app.cli.bench_pool_direct import pool_direct_command
from app.cli.bench_routing import routing_command
from app.cli.bench_soak import soak_command
from app.cli.bench_tables import tables_command
from app.cli.bench_turns import turns_command

bench_app = typer.Typer(
    help="Benchmarks: the sidecar against raw Mooncake (no subcommand), P/D side by side "
    "(pd), open-loop load (load), prefill routing policies (routing), or faults under load "
    "(faults), multi-turn (turns, chat-keys, pool-vs-direct), soak (soak); the docs' tables "
    "from the committed results (tables).",
    invoke_without_command=True,
    pretty_exceptions_enable=False,
)


@bench_app.callback()
def bench_command(
    ctx: typer.Context,
    quick: Annotated[
        bool, typer.Option("--quick", help="One cluster, fewer points: under a minute here.")
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    out: Annotated[
        Path, typer.Option(help="Directory for bench.json, the plot and the process logs.")
    ] = Path("bench-out"),
    reps: Annotated[int | None, typer.Option(help="Repetitions per measurement.")] = None,
    compute_ratio: Annotated[
        float | None,
        typer.Option(help="Simulated compute per layer, as a multiple of one layer's raw write."),
    ] = None,
    plot_png: Annotated[bool, typer.Option("--plot/--no-plot", help="Write exposed.png.")] = True,
) -> None:
    """Measure the layer-wise pipeline against raw Mooncake writes, over the real engine."""
    if ctx.invoked_subcommand is not None:
        return  # `bench pd ...`: its own options
    # Heavy imports inside the command: see app/cli/main.py.
    from app.bench.core.host import LOOPBACK, host_record
    from app.bench.core.result_file import print_host, result_json, write_result
    from app.bench.goodput.report import plot, print_table, summarize
    from app.bench.goodput.runner import BenchOptions, run_bench

    opts = BenchOptions.quick_preset() if quick else BenchOptions()
    if reps is not None:
        opts.reps = opts.overlap_reps = max(1, reps)
    if compute_ratio is not None:
        opts.compute_ratio = compute_ratio
    out.mkdir(parents=True, exist_ok=True)
    opts.log_dir = str(out / "logs")
    summary = summarize(run_bench(opts))
    if plot_png:
        try:
            summary["plot"] = str(plot(summary, out / "exposed.png"))
        except ImportError:
            summary["plot"] = None  # matplotlib is the optional 'bench' extra
    # The simulated engines and raw Mooncake peers, on loopback: no vLLM engine.
    host = host_record(engines={}, link=LOOPBACK)
    record = write_result(out / "bench.json", summary, host)
    if as_json:
        print(result_json(record))
    else:
        print_table(summary, Console())
        print_host(host, Console())
        if summary.get("plot") is None and plot_png:
            Console().print("no plot: install matplotlib (the 'bench' extra)")


bench_app.command("pd")(pd_command)
bench_app.command("load")(load_command)
bench_app.command("routing")(routing_command)
bench_app.command("faults")(faults_command)
bench_app.command("turns")(turns_command)
bench_app.command("soak")(soak_command)
bench_app.command("chat-keys")(chat_keys_command)
bench_app.command("pool-vs-direct")(pool_direct_command)
bench_app.command("tables")(tables_command)
