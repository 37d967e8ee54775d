"""``kv-sidecar plan``: the regions and the per-group transfer plan of one request pairing."""

from __future__ import annotations

import json
import time
from enum import StrEnum
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from app.kvcache.groups import group_rows
from app.kvcache.layout import KVLayout, LayoutMode
from app.kvcache.presets import load_preset
from app.transfer.planning.planner import Descriptors


class SendMode(StrEnum):
    LAYERWISE = "layerwise"
    BULK = "bulk"


def plan_report(
    model: str,
    prefill_tp: int,
    decode_tp: int,
    prompt_tokens: int,
    *,
    requests: int = 1,
    layout: LayoutMode = LayoutMode.PER_LAYER,
    kv_layout: KVLayout = KVLayout.HND,
    heads_major: bool = False,
    block_size: int | None = None,
    layers: int | None = None,
    send_mode: SendMode = SendMode.LAYERWISE,
    cache_dtype: str = "auto",
) -> dict[str, Any]:
    """Plan ``requests`` prompts of ``prompt_tokens`` and report per group and in total."""
    # Heavy imports inside the command: see app/cli/main.py.
    from app.sim.reference import blocks_needed, build_instance, empty_allocator, run_transfer

    spec = load_preset(model, layers=layers, cache_dtype=cache_dtype)
    bs = block_size or spec.default_block_size()
    lens = [prompt_tokens] * requests
    p = build_instance(
        spec,
        prefill_tp,
        bs,
        blocks_needed(spec, prefill_tp, bs, lens),
        mode=layout,
        kv_layout=kv_layout,
        heads_major=heads_major,
        allocator=empty_allocator,
    )
    d = build_instance(
        spec,
        decode_tp,
        bs,
        blocks_needed(spec, decode_tp, bs, lens),
        mode=layout,
        kv_layout=kv_layout,
        heads_major=heads_major,
        allocator=empty_allocator,
        seed=1,
    )
    t0 = time.perf_counter()
    res = run_transfer(
        p,
        d,
        lens,
        bulk=send_mode is SendMode.BULK,
        fill=False,
        copy=False,
        verify=False,
        keep_plans=True,
    )
    wall_ms = (time.perf_counter() - t0) * 1e3
    # The minimum: maximal contiguous runs if each (P rank, D rank) pair sent in one submission.
    per_pair: dict[tuple[int, int], list[Descriptors]] = {}
    for pr, dr, _, descs in res.plans:
        per_pair.setdefault((pr, dr), []).append(descs)
    min_desc = sum(Descriptors.concat(v).coalesced().count for v in per_pair.values())
    groups = []
    for g, layer_spec, layer_ids in group_rows(p.config.groups):
        stats = res.per_group.get(g.index, [0, 0, 0])
        share = len(layer_ids) / len(g.layers)  # split a mixed group's counts by its layers
        groups.append(
            {
                "index": g.index,
                "spec": layer_spec.kind.value,
                "part": "indexer" if getattr(layer_spec, "indexer", False) else "main",
                "kind": layer_spec.region_kind.value,
                "block_size": g.block_size,
                "kernel_block_size": g.kernel_block_size,
                "page_size_bytes": p.config.slot_of(layer_ids[0]).page_bytes,
                "decode_page_size_bytes": d.config.slot_of(layer_ids[0]).page_bytes,
                "num_layers": len(layer_ids),
                "blocks_sent": round(stats[0] * share),
                "descriptors": round(stats[1] * share),
                "bytes": round(stats[2] * share),
                "description": layer_spec.describe(),
            }
        )
    regions = [
        {
            "rank": rank.rank,
            "base": hex(r.base),
            "length": r.length,
            "block_stride": r.block_stride,
            "kind": r.kind.value,
            "group": r.group,
            "layers": list(r.layers),
            "streams": [[s.offset, s.length] for s in r.streams],
        }
        for rank in p.ranks[:1]
        for r in rank.regions()
    ]
    return {
        "model": model,
        "prefill_tp": prefill_tp,
        "decode_tp": decode_tp,
        "prompt_tokens": prompt_tokens,
        "requests": requests,
        "layout": layout.value + ("+heads_major" if heads_major else ""),
        "kv_layout": kv_layout.value,
        "send_mode": send_mode.value,
        "prefill_block_size": p.config.block_size,
        "decode_block_size": d.config.block_size,
        "groups": groups,
        "regions": regions,
        "total_bytes": res.bytes,
        "total_descriptors": res.descriptors,
        "min_descriptors": min_desc,
        "planning_ms": round(res.planning_s * 1e3, 3),
        "wall_ms": round(wall_ms, 3),
    }


def plan_command(
    model: Annotated[str, typer.Option(help="Model preset name.")] = "qwen3-next-80b-a3b",
    prefill_tp: Annotated[int, typer.Option(help="Prefill TP size.")] = 4,
    decode_tp: Annotated[int, typer.Option(help="Decode TP size.")] = 2,
    prompt_tokens: Annotated[int, typer.Option(help="Prompt length in tokens.")] = 4096,
    requests: Annotated[int, typer.Option(help="Requests planned in one step.")] = 1,
    layout: Annotated[LayoutMode, typer.Option(help="Allocation layout.")] = LayoutMode.PER_LAYER,
    kv_layout: Annotated[KVLayout, typer.Option(help="Attention block layout.")] = KVLayout.HND,
    heads_major: Annotated[bool, typer.Option(help="Heads-major cross-layer blocks.")] = False,
    block_size: Annotated[int | None, typer.Option(help="Manager block size.")] = None,
    layers: Annotated[int | None, typer.Option(help="Scale down to this many layers.")] = None,
    send_mode: Annotated[SendMode, typer.Option(help="Per layer or all at once.")] = (
        SendMode.LAYERWISE
    ),
    cache_dtype: Annotated[str, typer.Option(help="MLA cache dtype (auto, fp8_ds_mla).")] = "auto",
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Print the region table and the per-group plan for one P -> D pairing."""
    if prompt_tokens < 1 or requests < 1:
        raise typer.BadParameter("--prompt-tokens and --requests must be at least 1")
    report = plan_report(
        model,
        prefill_tp,
        decode_tp,
        prompt_tokens,
        requests=requests,
        layout=layout,
        kv_layout=kv_layout,
        heads_major=heads_major,
        block_size=block_size,
        layers=layers,
        send_mode=send_mode,
        cache_dtype=cache_dtype,
    )
    if as_json:
        print(json.dumps(report))
        return
    _print(report)


def _print(r: dict[str, Any]) -> None:
    con = Console()
    con.print(
        f"[bold]{r['model']}[/] prefill TP {r['prefill_tp']} (block {r['prefill_block_size']}) "
        f"-> decode TP {r['decode_tp']} (block {r['decode_block_size']}), "
        f"{r['requests']} x {r['prompt_tokens']} tokens, {r['layout']} {r['kv_layout']}, "
        f"{r['send_mode']}"
    )
    regions = Table(title="Regions of prefill rank 0")
    for col in ("group", "kind", "base", "length", "block stride", "layers", "streams"):
        regions.add_column(col, justify="right" if col in ("length", "block stride") else "left")
    for reg in r["regions"]:
        layers = reg["layers"]
        shown = ",".join(map(str, layers)) if len(layers) <= 6 else f"{len(layers)} layers"
        regions.add_row(
            str(reg["group"]),
            reg["kind"],
            reg["base"],
            f"{reg['length']:,}",
            f"{reg['block_stride']:,}",
            shown,
            str(len(reg["streams"])),
        )
    con.print(regions)
    groups = Table(title="Plan per group")
    for col in (
        "group",
        "spec",
        "kind",
        "block",
        "page B (P/D)",
        "layers",
        "blocks sent",
        "descriptors",
        "bytes",
    ):
        groups.add_column(col)
    for g in r["groups"]:
        spec = g["spec"] + (" (indexer)" if g["part"] == "indexer" else "")
        groups.add_row(
            str(g["index"]),
            spec,
            g["kind"],
            str(g["block_size"]),
            f"{g['page_size_bytes']:,}/{g['decode_page_size_bytes']:,}",
            str(g["num_layers"]),
            f"{g['blocks_sent']:,}",
            f"{g['descriptors']:,}",
            f"{g['bytes']:,}",
        )
    con.print(groups)
    con.print(
        f"total {r['total_bytes']:,} bytes in {r['total_descriptors']:,} descriptors "
        f"(minimum possible {r['min_descriptors']:,}); planning {r['planning_ms']:.1f} ms"
    )
