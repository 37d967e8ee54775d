"""``bench pool-vs-direct``'s result as docs/benchmarks.md shows it: a row per object size."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from app.bench.core.tables import Table, mib, num

HEADER = (
    "object",
    "objects",
    "pool load ms, median (min-max)",
    "direct write ms",
    "pool / direct",
    "A/A pool / direct",
)


def _ms(sp: Mapping[str, Any]) -> str:
    return f"{num(sp['median'], 1)} ({num(sp['min'], 1)}-{num(sp['max'], 1)})"


def vs_direct(result: Mapping[str, Any]) -> Table:
    rows = tuple(
        (
            mib(r["object_bytes"]),
            str(r["objects"]),
            _ms(r["pool_load_ms"]),
            _ms(r["direct_ms"]),
            num(r["pool_over_direct"], 2),
            f"{num(r['aa_pool'], 2)} / {num(r['aa_direct'], 2)}",
        )
        for r in result["rows"]
    )
    return Table(HEADER, rows)
