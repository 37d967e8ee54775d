"""``python -m app.bench.scaling``'s result as docs/benchmarks.md shows it: a row per length."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from app.bench.core.tables import Table, grouped, mib, num

HEADER = (
    "tokens",
    "KV moved",
    "descriptors (min)",
    "planning CPU",
    "sidecars' CPU",
    "CPU s per GB",
    "handoff median (best rep)",
    "anon RSS peak P / D",
    "added above 1k P / D",
)


def _added(v: float) -> str:
    return "0" if v == 0 else num(v, 2)


def lengths(result: Mapping[str, Any]) -> Table:
    """Per length: the medians over the reps, the handoff's best rep, peak and added RSS."""
    rows = tuple(
        (
            grouped(r["tokens"]),
            mib(r["bytes"]),
            f"{grouped(r['descriptors'])} ({grouped(r['min_descriptors'])})",
            f"{num(r['planning_cpu_ms'], 2)} ms",
            f"{num(r['cpu_s'], 2)} s",
            num(r["cpu_s_per_gb"], 2),
            f"{num(r['handoff_ms'], 1)} ({num(r['handoff_ms_min'], 1)}) ms",
            f"{num(r['rss_anon_peak_mib_prefill'], 1)} / "
            f"{num(r['rss_anon_peak_mib_decode'], 1)} MiB",
            f"{_added(r['rss_anon_added_mib_prefill'])} / "
            f"{_added(r['rss_anon_added_mib_decode'])} MiB",
        )
        for r in result["rows"]
    )
    return Table(HEADER, rows, ("---:",) * len(HEADER))
