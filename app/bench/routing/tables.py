"""``bench routing``'s result as docs/benchmarks.md shows it: a row per figure, a column per
policy, each the median over the reps [min–max]."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from app.bench.core.tables import Table, num
from app.bench.routing.bench import POLICIES

FIGURES = (  # summary key, label, decimals
    ("prefill_tokens_computed", "prefill tokens computed", 0),
    ("hit_rate", "prefix-cache hit rate", 2),
    ("ttft_p50_ms", "TTFT P50 ms", 0),
    ("ttft_p90_ms", "TTFT P90 ms", 0),
    ("tail_in_burst", "slowest tenth: of the burst", 0),
    ("tail_decode_target_ms", "slowest tenth: decode's target ms", 0),
    ("tail_prefill_ms", "slowest tenth: prefill call ms", 0),
)


def _cell(sp: Mapping[str, Any], digits: int) -> str:
    if sp["median"] is None:
        return "-"
    return f"{num(sp['median'], digits)} [{num(sp['min'], digits)}–{num(sp['max'], digits)}]"


def policies(result: Mapping[str, Any]) -> Table:
    per = result["summary"]["policies"]
    rows = tuple(
        (label, *(_cell(per[p][key], digits) for p in POLICIES)) for key, label, digits in FIGURES
    )
    return Table(("", *POLICIES), rows)
