"""One request's per-layer timeline against prefill's forward pass, from both sidecars'
records (``GET /v1/requests/{id}``): printed as a table and drawn to a PNG.

Times are milliseconds from the start of prefill's first step (the step announced to its
sidecar right before its forward pass). A push that is layer by layer lands most layers
before the forward pass ends; one that is not shows every layer signalled at its end.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

from app.errors import DeadlineExceeded


@dataclass(frozen=True)
class LayerRow:
    step: int
    layer: int
    signalled_ms: float
    at_step_end: bool
    submitted_ms: float | None
    landed_ms: float | None
    bytes: int


@dataclass(frozen=True)
class Timeline:
    request: str
    rows: list[LayerRow]
    steps: list[tuple[int, float, float]]  # step, forward start ms, forward end ms
    decode_done_ms: float | None

    def as_dict(self) -> dict[str, Any]:
        return {
            "request": self.request,
            "layers": [r.__dict__ for r in self.rows],
            "steps": [{"step": s, "start_ms": a, "end_ms": b} for s, a, b in self.steps],
            "decode_done_ms": self.decode_done_ms,
        }


def from_dict(d: dict[str, Any]) -> Timeline:
    """``Timeline.as_dict`` read back (the demo's JSON summary)."""
    return Timeline(
        d["request"],
        [LayerRow(**r) for r in d["layers"]],
        [(s["step"], s["start_ms"], s["end_ms"]) for s in d["steps"]],
        d["decode_done_ms"],
    )


def _entry(admin: str, rid: str, side: str) -> dict[str, Any]:
    r = httpx.get(f"{admin}/v1/requests/{rid}", timeout=10)
    r.raise_for_status()
    found = [e for e in r.json()["entries"] if e["side"] == side]
    if not found:
        raise DeadlineExceeded(f"{admin} holds no {side} record of {rid}")
    return dict(found[0])


def fetch(prefill_admin: str, decode_admin: str, rid: str, timeout_s: float = 30.0) -> Timeline:
    """The timeline of ``rid`` once prefill's forward pass ended (decode may answer first)."""
    deadline = time.monotonic() + timeout_s
    while True:
        send = _entry(prefill_admin, rid, "send")
        if send["steps"] and all(s["forward_ended_at"] is not None for s in send["steps"]):
            break
        if time.monotonic() > deadline:
            raise DeadlineExceeded(f"prefill's forward pass for {rid} did not end in {timeout_s}s")
        time.sleep(0.1)
    return timeline(rid, send, _entry(decode_admin, rid, "recv"))


def timeline(rid: str, send: dict[str, Any], recv: dict[str, Any]) -> Timeline:
    """Pure: the rows of a send and receive record, in ms from prefill's first step."""
    t0 = min(s["began_at"] for s in send["steps"])

    def ms(t: float | None) -> float | None:
        return None if t is None else round((t - t0) * 1e3, 1)

    rows = [
        LayerRow(
            t["step"],
            t["layer"],
            round((t["signalled_at"] - t0) * 1e3, 1),
            t["at_step_end"],
            ms(t["submitted_at"]),
            ms(t["landed_at"]),
            t["bytes"],
        )
        for t in send["layers"]
    ]
    steps = [
        (
            s["step"],
            round((s["began_at"] - t0) * 1e3, 1),
            round((s["forward_ended_at"] - t0) * 1e3, 1),
        )
        for s in send["steps"]
    ]
    return Timeline(rid, rows, steps, ms(recv.get("ended_at")))


def print_table(console: Console, tl: Timeline) -> None:
    table = Table(title=f"layer timeline of {tl.request} (ms from prefill's forward start)")
    for col in ("step", "layer", "signalled", "submitted", "landed", "KiB"):
        table.add_column(col, justify="right")
    for r in tl.rows:
        mark = " (step end)" if r.at_step_end else ""
        table.add_row(
            str(r.step),
            str(r.layer),
            f"{r.signalled_ms:.1f}{mark}",
            "-" if r.submitted_ms is None else f"{r.submitted_ms:.1f}",
            "-" if r.landed_ms is None else f"{r.landed_ms:.1f}",
            f"{r.bytes / 1024:.0f}",
        )
    console.print(table)
    ends = ", ".join(f"step {s}: {a:.1f} → {b:.1f}" for s, a, b in tl.steps)
    landed = [r.landed_ms for r in tl.rows if r.landed_ms is not None]
    before = sum(1 for x in landed if x <= tl.steps[-1][2])
    console.print(
        f"prefill forward: {ends} ms; {before}/{len(tl.rows)} layers landed before its end; "
        f"decode had the KV at {tl.decode_done_ms} ms"
    )


def plot(tl: Timeline, path: Path) -> Path | None:
    """Draw the timeline to ``path``; None without matplotlib (the optional 'bench' extra)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(9, 0.35 * len(tl.rows) + 1.5))
    for s, start, end in tl.steps:
        ax.axvspan(
            start, end, color="0.9", label="prefill forward" if s == tl.steps[0][0] else None
        )
    for i, r in enumerate(tl.rows):
        if r.submitted_ms is not None and r.landed_ms is not None:
            ax.plot([r.submitted_ms, r.landed_ms], [i, i], color="tab:blue", linewidth=4)
        ax.plot(r.signalled_ms, i, "|", color="tab:red" if r.at_step_end else "tab:green", ms=12)
    if tl.decode_done_ms is not None:
        ax.axvline(tl.decode_done_ms, color="tab:purple", linestyle="--", label="decode has the KV")
    ax.set_yticks(range(len(tl.rows)), [f"s{r.step} L{r.layer}" for r in tl.rows])
    ax.invert_yaxis()
    ax.set_xlabel("ms from prefill's forward start (|: signalled, bar: write submitted → landed)")
    ax.set_title(f"layer-wise push of {tl.request}")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
