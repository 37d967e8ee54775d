"""``bench faults``' result as docs/benchmarks.md shows it: a row per phase (the control, then
each fault), what its requests got and when goodput came back."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from app.bench.core.tables import Table, num

HEADER = (
    "fault",
    "sent",
    "errors",
    "wrong",
    "lost",
    "changed B (blocks / bound)",
    "goodput back s",
    "restart s",
    "SLO met before / after",
)


def _share(v: float | None) -> str:
    return "-" if v is None else f"{num(100 * v)}%"


def _back(r: Mapping[str, Any]) -> str:
    if r["fault"] == "none":
        return "-"  # the control: nothing to come back from
    return "not back" if r["back_s"] is None else num(r["back_s"], 1)


def phases(result: Mapping[str, Any]) -> Table:
    rows = tuple(
        (
            "none (control)" if r["fault"] == "none" else r["fault"],
            str(r["sent"]),
            str(r["errors"]),
            str(r["wrong"]),
            str(r["lost"]),
            f"{r['changed_bytes']} ({r['changed_blocks']} / ≤{r['alone_blocks']})",
            _back(r),
            "-" if r["restart_s"] is None else num(r["restart_s"], 1),
            f"{_share(r['attainment_before'])} / {_share(r['attainment_after'])}",
        )
        for r in result["rows"]
    )
    return Table(HEADER, rows)
