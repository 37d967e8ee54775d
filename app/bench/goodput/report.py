"""The bench's headline numbers, its goals, the table and the plot."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from app.bench.goodput.runner import VERIFY_LENS

MiB = 1 << 20
RSS_FLAT_BYTES = 8 * MiB  # anonymous RSS growth over repeated 256-request passes still "flat"


def _reference(overlap: list[dict[str, Any]], tokens: int) -> dict[str, Any]:
    """The overlap row at ``tokens`` (the goodput prompt length), else the longest."""
    by_len = {r["prompt_tokens"]: r for r in overlap}
    return by_len.get(tokens) or overlap[-1]


def _layer_trend(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Overlap ratio against layer count for the main model (same prompt length)."""
    main = report["layouts"][next(iter(report["layouts"]))]
    rows: list[dict[str, Any]] = []
    for p in report.get("points", []):
        # One model's per-layer size, more of its layers: the trend the goal is about.
        if "error" in p or p["model"] != report["model"]:
            continue
        ref = next(
            (o for o in main["overlap"] if o["prompt_tokens"] == p["overlap"]["prompt_tokens"]),
            None,
        )
        if ref is not None and not rows:
            rows.append({"model": report["model"], "layers": report["layers"], **_ratio_row(ref)})
        rows.append({"model": p["model"], "layers": p["layers"], **_ratio_row(p["overlap"])})
    return sorted(rows, key=lambda r: r["layers"])


def _ratio_row(o: dict[str, Any]) -> dict[str, Any]:
    return {
        "prompt_tokens": o["prompt_tokens"],
        "exposed_ms": o["exposed_ms"],
        "bulk_exposed_ms": o["bulk_exposed_ms"],
        "overlap_ratio": o["overlap_ratio"],
    }


def summarize(report: dict[str, Any]) -> dict[str, Any]:
    """Headline keys first, then the goals, then every section in detail."""
    layouts = report["layouts"]
    main_name = next(iter(layouts))
    main = layouts[main_name]
    good = main["goodput"]
    ref = _reference(main["overlap"], good["prompt_tokens"])
    modes: dict[str, dict[str, int]] = {}
    for name, sec in layouts.items():
        row = _reference(sec["overlap"], good["prompt_tokens"])
        modes[f"{name}/layerwise"] = {
            "descriptors": row["descriptors"]["layerwise"],
            "min_descriptors": row["min_descriptors"]["layerwise"],
        }
        modes[f"{name}/bulk"] = {
            "descriptors": row["descriptors"]["bulk"],
            "min_descriptors": row["min_descriptors"]["bulk"],
        }
    scale = main["scale"]
    fractions = [good["planning_fraction"]] + [
        r["planning_fraction"] for r in scale["rows"] if "planning_fraction" in r
    ]
    rss_growth = max(scale["rss_growth_bytes"].values())
    trend = _layer_trend(report)
    out: dict[str, Any] = {
        "raw_gbps": good["raw_gbps"],
        "layerwise_gbps": good["layerwise_gbps"],
        "goodput_ratio": good["goodput_ratio"],
        "exposed_ms": ref["exposed_ms"],
        "bulk_exposed_ms": ref["bulk_exposed_ms"],
        "overlap_ratio": ref["overlap_ratio"],
        "layer_ms": ref["layer_ms"],
        "descriptors": sum(m["descriptors"] for m in modes.values()),
        "min_descriptors": sum(m["min_descriptors"] for m in modes.values()),
        "planning_fraction": max(fractions),
        "max_in_flight": scale["max_in_flight"],
        "failures": report["failures"],
        "rss_growth": round(rss_growth / MiB, 3),  # MiB, anonymous, max over the sidecars
        # Requests checked byte-exact (fill at P, every byte at D), both send modes per cluster.
        "verified": sum(sec.get("verified", 0) for sec in layouts.values())
        + sum(p.get("verified", 0) for p in report.get("points", [])),
        "verify_runs": 2 * len(VERIFY_LENS) * (len(layouts) + len(report.get("points", []))),
    }
    goals = {
        "goodput_ratio >= 0.9": out["goodput_ratio"] >= 0.9,
        **{
            f"exposed <= 1.5 x last layer + 2 ms ({name}, every length)": all(
                o["exposed_ok"] for o in sec["overlap"]
            )
            for name, sec in layouts.items()
        },
        "overlap_ratio shrinks as layers grow": (
            all(b["overlap_ratio"] < a["overlap_ratio"] for a, b in itertools.pairwise(trend))
            if len(trend) > 1
            else None
        ),
        "descriptors == min_descriptors (every mode)": all(
            m["descriptors"] == m["min_descriptors"] for m in modes.values()
        ),
        "planning_fraction <= 0.05": out["planning_fraction"] <= 0.05,
        "256 in flight, no failure": out["max_in_flight"] >= 256 and out["failures"] == 0,
        f"RSS flat after warm-up (<= {RSS_FLAT_BYTES // MiB} MiB)": rss_growth <= RSS_FLAT_BYTES,
    }
    out["goals"] = goals
    out["descriptor_modes"] = modes
    out["overlap"] = {name: sec["overlap"] for name, sec in layouts.items()}
    out["layers_trend"] = trend
    out["requests_scale"] = scale["rows"]
    out["points"] = report.get("points", [])
    out["rss"] = scale["rss"]
    out["run"] = {
        k: report[k]
        for k in (
            "model",
            "layers",
            "prefill_tp",
            "decode_tp",
            "quick",
            "compute_ratio",
            "poll_ms",
            "overlap_poll_ms",
            "wall_s",
        )
        if k in report
    }
    out["goodput"] = {name: sec["goodput"] for name, sec in layouts.items()}
    out["failures_detail"] = report.get("failures_detail", {})
    out["errors"] = [
        f"{p['model']} x{p['layers']}: {p['error']}" for p in out["points"] if "error" in p
    ]
    return out


def print_table(s: dict[str, Any], con: Console | None = None) -> None:
    con = con or Console()
    run = s["run"]
    con.print(
        f"[bold]{run['model']}[/] x{run['layers']} layers, prefill TP {run['prefill_tp']} -> "
        f"decode TP {run['decode_tp']}, {'quick' if run['quick'] else 'full'} run "
        f"({run.get('wall_s', 0):.0f} s)"
    )
    head = Table(title="Headline")
    for col in ("metric", "value"):
        head.add_column(col)
    for key in (
        "raw_gbps",
        "layerwise_gbps",
        "goodput_ratio",
        "layer_ms",
        "exposed_ms",
        "bulk_exposed_ms",
        "overlap_ratio",
        "descriptors",
        "min_descriptors",
        "planning_fraction",
        "max_in_flight",
        "failures",
        "rss_growth",
        "verified",
    ):
        head.add_row(key + (" (MiB)" if key == "rss_growth" else ""), str(s[key]))
    con.print(head)
    ov = Table(title="Exposed time after the last layer (ms)")
    for col in ("layout", "tokens", "layer", "compute", "layer-wise", "bulk", "ratio", "limit"):
        ov.add_column(col, justify="right")
    for name, rows in s["overlap"].items():
        for o in rows:
            ov.add_row(
                name,
                str(o["prompt_tokens"]),
                f"{o['layer_ms']:.1f}",
                f"{o['compute_ms']:.1f}",
                f"{o['exposed_ms']:.1f}",
                f"{o['bulk_exposed_ms']:.1f}",
                f"{o['overlap_ratio']}",
                f"{o['exposed_limit_ms']:.1f}" + ("" if o["exposed_ok"] else " [red]x[/]"),
            )
    con.print(ov)
    desc = Table(title="Descriptors (reference length)")
    for col in ("mode", "submitted", "minimum"):
        desc.add_column(col, justify="right")
    for mode, m in s["descriptor_modes"].items():
        desc.add_row(mode, str(m["descriptors"]), str(m["min_descriptors"]))
    con.print(desc)
    sc = Table(title="Requests in flight")
    for col in ("requests", "tokens", "GB/s", "goodput", "descriptors", "min", "plan ms", "plan %"):
        sc.add_column(col, justify="right")
    for r in s["requests_scale"]:
        sc.add_row(
            str(r["requests"]),
            str(r["prompt_tokens"]),
            f"{r['gbps']:.3f}",
            f"{r['goodput_ratio']:.2f}",
            str(r["descriptors"]),
            str(r["min_descriptors"]),
            str(r.get("planning_ms_per_layer", "")),
            f"{100 * r['planning_fraction']:.2f}" if "planning_fraction" in r else "",
        )
    con.print(sc)
    if s["points"]:
        pt = Table(title="Layers and groups")
        for col in ("model", "layers", "groups", "GB/s", "goodput", "exposed", "bulk", "ratio"):
            pt.add_column(col, justify="right")
        for p in s["points"]:
            if "error" in p:
                pt.add_row(p["model"], str(p["layers"]), "", "", "", "", "", p["error"][:40])
                continue
            o = p["overlap"]
            pt.add_row(
                p["model"],
                str(p["layers"]),
                str(p["groups"]),
                f"{p['layerwise_gbps']:.3f}",
                f"{p['goodput_ratio']:.2f}",
                f"{o['exposed_ms']:.1f}",
                f"{o['bulk_exposed_ms']:.1f}",
                str(o["overlap_ratio"]),
            )
        con.print(pt)
    goals = Table(title="Goals")
    goals.add_column("goal")
    goals.add_column("met")
    for g, met in s["goals"].items():
        goals.add_row(g, "n/a" if met is None else ("[green]yes[/]" if met else "[red]no[/]"))
    con.print(goals)


def plot(s: dict[str, Any], path: Path) -> Path:
    """Exposed time against prompt length, layer-wise and bulk (needs the ``bench`` extra)."""
    import matplotlib

    matplotlib.use("Agg")  # no display here, and none wanted
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    styles = ["-", "--", ":"]
    for i, (name, rows) in enumerate(s["overlap"].items()):
        x = [o["prompt_tokens"] for o in rows]
        ls = styles[i % len(styles)]
        lay = [o["exposed_ms"] for o in rows]
        bulk = [o["bulk_exposed_ms"] for o in rows]
        ax.plot(x, lay, "o" + ls, color="C0", label=f"layer-wise ({name})")
        ax.plot(x, bulk, "s" + ls, color="C3", label=f"bulk ({name})")
        if i == 0:
            ax.plot(
                x,
                [o["exposed_limit_ms"] for o in rows],
                ls,
                color="grey",
                label="goal: 1.5 x one layer + 2 ms",
            )
    run = s["run"]
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("prompt length (tokens)")
    ax.set_ylabel("exposed transfer time after the last layer (ms)")
    ax.set_title(
        f"{run['model']} x{run['layers']} layers, TP {run['prefill_tp']}->{run['decode_tp']}, "
        "Mooncake TCP loopback"
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
