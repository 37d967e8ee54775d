"""Decode's time to target under load, per request (issue 36 item 3): from the proxy's start,
when decode's sidecar admitted the request (decode's step announced it), when the target
reached the proxy (decode's post), and when prefill's first layer write left (prefill's fetch
and its first submit). Pure: the proxy's and the sidecars' records in, figures out."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from app.bench.core.slo import percentile

STAGES = ("announced_ms", "target_ms", "first_write_ms")


def _first_submit(send: Mapping[str, Any]) -> float | None:
    cols = list(send.get("layer_columns") or ())
    if "submitted_at" not in cols:
        return None
    k = cols.index("submitted_at")
    times = [row[k] for row in send.get("layers") or () if row[k] is not None]
    return min(times) if times else None


def target_times(
    proxy: Iterable[Mapping[str, Any]], records: Iterable[Mapping[str, Any]], ids: Iterable[str]
) -> list[dict[str, Any]]:
    """Per transfer of ``ids`` the proxy disaggregated: ms from its start to D's sidecar
    admitting it, to the target at the proxy, and to P's first layer submitted (None where a
    record lacks it: a request decode served alone has no target)."""
    wanted = set(ids)
    recv_at: dict[str, float] = {}
    write_at: dict[str, float] = {}
    for r in records:
        if r.get("side") == "recv" and r.get("created_at") is not None:
            recv_at[r["id"]] = min(float(r["created_at"]), recv_at.get(r["id"], float("inf")))
        elif r.get("side") == "send" and (t := _first_submit(r)) is not None:
            write_at[r["id"]] = min(t, write_at.get(r["id"], float("inf")))
    out = []
    for p in proxy:
        tid = p["transfer_id"]
        if tid not in wanted or not p.get("disaggregated"):
            continue
        start = float(p["started_at"])

        def since(t: float | None, start: float = start) -> float | None:
            return None if t is None else round(1e3 * (t - start), 1)

        out.append(
            {
                "transfer_id": tid,
                "announced_ms": since(recv_at.get(tid)),
                "target_ms": p.get("target_ms"),
                "first_write_ms": since(write_at.get(tid)),
            }
        )
    return out


def summarize(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """P50 and P90 of each stage over a step's transfers, and how many had it."""
    out: dict[str, Any] = {"n": len(rows)}
    for stage in STAGES:
        vals = [float(r[stage]) for r in rows if r.get(stage) is not None]
        out[stage] = {"n": len(vals), "p50": percentile(vals, 50), "p90": percentile(vals, 90)}
    return out
