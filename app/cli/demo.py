"""``kv-sidecar demo``: a local P/D pair over the real Mooncake engine, verified byte-exact."""

from __future__ import annotations

import json
import signal
import sys
import threading
import time
from types import FrameType
from typing import TYPE_CHECKING, Annotated, Any

import httpx
import typer
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

from app.errors import ConfigError, DeadlineExceeded
from app.kvcache.layout import KVLayout, LayoutMode

if TYPE_CHECKING:
    from app.sim.cluster import Cluster
    from app.sim.commands import SimRequest

_READY_TIMEOUT_S = 60.0


def demo_command(
    model: Annotated[str, typer.Option(help="Model preset.")] = "qwen3-next-80b-a3b",
    prefill_tp: Annotated[int, typer.Option(help="Prefill TP size.")] = 2,
    decode_tp: Annotated[int, typer.Option(help="Decode TP size.")] = 1,
    layers: Annotated[int, typer.Option(help="Scale the model down to this many layers.")] = 8,
    requests: Annotated[int, typer.Option(help="Concurrent requests.")] = 4,
    prompt_tokens: Annotated[int, typer.Option(help="Prompt length.")] = 1024,
    layout: Annotated[LayoutMode, typer.Option(help="Allocation layout.")] = LayoutMode.PER_LAYER,
    kv_layout: Annotated[KVLayout, typer.Option(help="Attention block layout.")] = KVLayout.HND,
    chunk: Annotated[int | None, typer.Option(help="Chunked-prefill size in tokens.")] = 512,
    compute_ms: Annotated[float, typer.Option(help="Simulated compute per layer.")] = 2.0,
    pool: Annotated[
        bool,
        typer.Option(
            "--pool",
            help="Also start a mooncake_master: save a request to the KV pool at prefill, then "
            "load a second request sharing its prefix from the pool at decode and verify it. "
            "With --engine vllm: decode stores each answer, and the first conversation's next "
            "turn loads its history at prefill.",
        ),
    ] = False,
    keep_alive: Annotated[
        bool,
        typer.Option(
            "--keep-alive",
            help="After the run, keep both sidecars up (curl their admin APIs) until Ctrl-C.",
        ),
    ] = False,
    as_json: Annotated[
        bool,
        typer.Option(
            "--json",
            help="Print one JSON object (with --keep-alive: first the admin URLs, then it).",
        ),
    ] = False,
    engine: Annotated[
        str, typer.Option(help="sim (simulated engines) or vllm (two real vLLM engines).")
    ] = "sim",
    vllm_model: Annotated[
        str, typer.Option(help="With --engine vllm: llama, gemma3, qwen3next or deepseek.")
    ] = "llama",
    max_tokens: Annotated[int, typer.Option(help="With --engine vllm: tokens to generate.")] = 8,
) -> None:
    """Start a P and a D sidecar with simulated engines (or real vLLM ones), transfer, verify,
    summarize."""
    # Heavy imports inside the command: see app/cli/main.py.
    from app.cli.demo_vllm import print_summary, run_vllm_demo, succeeded
    from app.sim.cluster import Cluster, ClusterSpec
    from app.sim.rounds import pool_prompt_tokens, pool_round, summarize

    if engine == "vllm":
        result = run_vllm_demo(vllm_model, requests, prompt_tokens, max_tokens, None, pool)
        print_summary(result, as_json)
        if not succeeded(result):
            raise typer.Exit(1)
        return
    if engine != "sim":
        raise ConfigError(f"--engine {engine!r}: expected sim or vllm")
    pool_tokens = pool_prompt_tokens(
        ClusterSpec(model=model, layers=layers, prefill_tp=prefill_tp, decode_tp=decode_tp),
        prompt_tokens,
    )
    spec = ClusterSpec(
        model=model,
        layers=layers,
        prefill_tp=prefill_tp,
        decode_tp=decode_tp,
        layout=layout.value,
        kv_layout=kv_layout.value,
        max_requests=requests + (2 if pool else 0),
        max_prompt=max(prompt_tokens, pool_tokens + pool_tokens // 4 if pool else 0),
        pool=pool,
    )
    console = Console(stderr=as_json)
    # SIGTERM ends the demo like Ctrl-C does, so the sidecars and engines are stopped too; SIGINT
    # is set explicitly because a shell starts background jobs with it ignored.
    previous = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    summary: dict[str, Any] | None = None
    try:
        with Cluster(spec) as cluster:
            urls = {
                "prefill_admin": cluster.sides["prefill"].admin_url,
                "decode_admin": cluster.sides["decode"].admin_url,
            }
            if keep_alive:
                _wait_ready(list(urls.values()))
                if as_json:
                    print(json.dumps(urls), flush=True)
            pairs = cluster.make_requests([prompt_tokens] * requests)
            result = _run(cluster, pairs, chunk, compute_ms, console if not as_json else None)
            summary = summarize(result, pairs)
            summary.update(
                {
                    "model": model,
                    "prefill_tp": prefill_tp,
                    "decode_tp": decode_tp,
                    "layers": layers,
                    "prompt_tokens": prompt_tokens,
                    "layout": layout.value,
                    **urls,
                }
            )
            if pool:
                summary.update(pool_round(cluster, prompt_tokens))
            if as_json:
                print(json.dumps(summary), flush=True)
            else:
                _print(console, summary)
            if keep_alive:
                if not as_json:
                    console.print("Sidecars keep running for curl; press Ctrl-C to stop them.")
                _wait_for_stop()
    except KeyboardInterrupt:
        # With --keep-alive, Ctrl-C after the summary is the normal way out.
        if summary is None or not keep_alive:
            raise typer.Exit(130) from None
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if (
        summary["failed"]
        or summary["verified"] != summary["requests"]
        or (pool and not summary["pool_verified"])
    ):
        raise typer.Exit(1)


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def _wait_for_stop() -> None:
    """Block until SIGINT or SIGTERM (both raise KeyboardInterrupt here)."""
    stop = threading.Event()
    while not stop.wait(1.0):
        pass


def _wait_ready(urls: list[str]) -> None:
    """Until every admin API answers ``/readyz`` with 200."""
    deadline = time.monotonic() + _READY_TIMEOUT_S
    with httpx.Client(timeout=2) as http:
        for url in urls:
            while True:
                try:
                    if http.get(f"{url}/readyz").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass  # not listening yet
                if time.monotonic() > deadline:
                    raise DeadlineExceeded(
                        f"the sidecar at {url} was not ready within {_READY_TIMEOUT_S:.0f}s"
                    )
                time.sleep(0.1)


def _run(
    cluster: Cluster,
    pairs: list[tuple[SimRequest, SimRequest]],
    chunk: int | None,
    compute_ms: float,
    console: Console | None,
) -> dict[str, Any]:
    """``cluster.run``, with a progress bar fed by both admin APIs when there is a console."""
    if console is None:
        return cluster.run(pairs, chunk=chunk, compute_ms=compute_ms)
    out: dict[str, Any] = {}

    def work() -> None:
        try:
            out["result"] = cluster.run(pairs, chunk=chunk, compute_ms=compute_ms)
        except BaseException as e:  # handed to the main thread
            out["error"] = e

    d_url = cluster.sides["decode"].admin_url
    p_url = cluster.sides["prefill"].admin_url
    with httpx.Client(timeout=1) as http:
        base_done = _requests_ended(http, d_url) or 0
        base_bytes = _bytes_sent(http, p_url) or 0
        # A daemon thread: Ctrl-C must not wait for a run that the cluster's exit will cut short.
        runner = threading.Thread(target=work, name="demo-run", daemon=True)
        columns = (
            SpinnerColumn(),
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("requests · {task.fields[sent]}"),
            TimeElapsedColumn(),
        )
        with Progress(*columns, console=console, transient=True) as progress:
            task = progress.add_task("transferring", total=len(pairs), sent="0.0 MB sent")
            runner.start()
            while runner.is_alive():
                runner.join(0.2)
                done = _requests_ended(http, d_url)
                sent = _bytes_sent(http, p_url)
                if done is not None:
                    progress.update(task, completed=min(len(pairs), done - base_done))
                if sent is not None:
                    progress.update(task, sent=f"{(sent - base_bytes) / 1e6:.1f} MB sent")
    if "error" in out:
        raise out["error"]
    result: dict[str, Any] = out["result"]
    return result


def _requests_ended(http: httpx.Client, url: str) -> int | None:
    """Requests every decode rank has finished (any final state); None if it did not answer."""
    try:
        ranks = http.get(f"{url}/v1/status").json()["ranks"]
    except (httpx.HTTPError, ValueError, KeyError):
        return None
    return min((int(r["recvs_ended"]) for r in ranks), default=0)


def _bytes_sent(http: httpx.Client, url: str) -> int | None:
    try:
        mooncake = http.get(f"{url}/v1/status").json()["mooncake"]
    except (httpx.HTTPError, ValueError, KeyError):
        return None
    return int(mooncake["bytes"]) if mooncake else None


def _print(console: Console, s: dict[str, Any]) -> None:
    t = Table(
        title=f"{s['model']} ({s['layers']} layers) prefill TP {s['prefill_tp']} -> "
        f"decode TP {s['decode_tp']}, {s['layout']}"
    )
    for col in (
        "requests",
        "verified",
        "failed",
        "bytes",
        "GB/s",
        "exposed transfer ms",
        "descriptors",
    ):
        t.add_column(col, justify="right")
    t.add_row(
        str(s["requests"]),
        str(s["verified"]),
        f"[red]{s['failed']}[/]" if s["failed"] else "0",
        f"{s['bytes']:,}",
        f"{s['gbps']:.3f}",
        f"{s['exposed_ms']:.1f}",
        f"{s['descriptors']:,}",
    )
    console.print(t)
    for rid, f in s["failures"].items():
        console.print(f"[red]{rid}: {f['status']}[/] {f['error']}")
    if "pool_verified" in s:
        ok = "[green]verified[/]" if s["pool_verified"] else "[red]NOT verified[/]"
        console.print(
            f"KV pool: {s['pool_saved_keys']} keys saved at prefill; the request sharing the "
            f"prefix hit {s['pool_hit_tokens']} tokens at decode, loaded "
            f"{s['pool_loaded_bytes']:,} bytes, {ok}"
        )
    console.print(f"prefill admin: {s['prefill_admin']}   decode admin: {s['decode_admin']}")
    sys.stdout.flush()
