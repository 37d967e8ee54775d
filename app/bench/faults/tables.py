"""``bench faults``' result as docs/benchmarks.md shows it: a row per phase (the control, then
each fault), what its requests got and when goodput came back."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from app.bench.core.tables import Table, num
from app.bench.faults.report import HEADER, back_cell, changed_cell


def _share(v: float | None) -> str:
    return "-" if v is None else f"{num(100 * v)}%"


def phases(result: Mapping[str, Any]) -> Table:
    rows = tuple(
        (
            "none (control)" if r["fault"] == "none" else r["fault"],
            str(r["sent"]),
            str(r["errors"]),
            str(r["wrong"]),
            str(r["lost"]),
            changed_cell(r),
            back_cell(r),
            "-" if r["restart_s"] is None else num(r["restart_s"], 1),
            f"{_share(r['attainment_before'])} / {_share(r['attainment_after'])}",
        )
        for r in result["rows"]
    )
    return Table(HEADER, rows)
