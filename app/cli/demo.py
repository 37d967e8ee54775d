"""``kv-sidecar demo``: a local P/D pair over the real Mooncake engine, verified byte-exact."""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from app.kvcache.layout import KVLayout, LayoutMode
from app.sim.cluster import Cluster, ClusterSpec, summarize


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
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Start a P and a D sidecar with simulated engines, transfer, verify, summarize."""
    spec = ClusterSpec(
        model=model,
        layers=layers,
        prefill_tp=prefill_tp,
        decode_tp=decode_tp,
        layout=layout.value,
        kv_layout=kv_layout.value,
        max_requests=requests,
        max_prompt=prompt_tokens,
    )
    with Cluster(spec) as cluster:
        pairs = cluster.make_requests([prompt_tokens] * requests)
        result = cluster.run(pairs, chunk=chunk, compute_ms=compute_ms)
        summary = summarize(result, pairs)
        summary.update(
            {
                "model": model,
                "prefill_tp": prefill_tp,
                "decode_tp": decode_tp,
                "layers": layers,
                "prompt_tokens": prompt_tokens,
                "layout": layout.value,
                "prefill_admin": cluster.sides["prefill"].admin_url,
                "decode_admin": cluster.sides["decode"].admin_url,
            }
        )
    if as_json:
        print(json.dumps(summary))
    else:
        _print(summary)
    if summary["failed"] or summary["verified"] != summary["requests"]:
        raise typer.Exit(1)


def _print(s: dict[str, Any]) -> None:
    t = Table(
        title=f"{s['model']} ({s['layers']} layers) prefill TP {s['prefill_tp']} -> "
        f"decode TP {s['decode_tp']}, {s['layout']}"
    )
    for col in ("requests", "verified", "failed", "bytes", "GB/s", "exposed ms", "descriptors"):
        t.add_column(col, justify="right")
    t.add_row(
        str(s["requests"]),
        str(s["verified"]),
        str(s["failed"]),
        f"{s['bytes']:,}",
        f"{s['gbps']:.3f}",
        f"{s['exposed_ms']:.1f}",
        f"{s['descriptors']:,}",
    )
    Console().print(t)
    for rid, f in s["failures"].items():
        Console().print(f"[red]{rid}: {f['status']}[/] {f['error']}")
