"""Pure logic of ``bench load`` on top of the SLO (``core.slo``): a rate step's percentiles,
throughput and goodput, the knee, the handoff, the link's calibration, the steps' summary."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from app.bench.core.slo import ATTAINMENT, Slo, judge, percentile, tail
from app.bench.core.stats import calibrate_link, spread
from app.errors import ConfigError


def _ms(v: float | None) -> float | None:
    return None if v is None else 1e3 * v


def _p99_ms(values: Sequence[float]) -> float | None:
    label, v = tail(values)
    return _ms(v) if label == "p99" else None


def step_figures(requests: Sequence[Mapping[str, Any]], slo: Slo) -> dict[str, Any]:
    """A rate step's figures from its requests (each with ``sent``, ``ended``, ...):
    throughput and goodput over the same span (first send → last end), completed and good
    requests per second; attainment = good / sent; ``after_p_*``: per request, P's answer back
    at the tap (``p_answered``) → the first token at the client, the handoff without P's
    queue (negative: decode answered before P's own answer was back)."""
    if not requests:
        raise ConfigError("a rate step with no request")
    judged = [judge(r, slo) for r in requests]
    span = max(r["ended"] for r in requests) - min(r["sent"] for r in requests)
    completed = sum(j["completed"] for j in judged)
    good = sum(j["good"] for j in judged)
    ttft = [j["ttft_s"] for j in judged if j["ttft_s"] is not None]
    tpot = [j["tpot_s"] for j in judged if j["tpot_s"] is not None]
    after_p = [
        r["first"] - r["p_answered"]
        for r in requests
        if r.get("first") is not None and r.get("p_answered") is not None
    ]
    return {
        "n_requests": len(requests),
        "completed": completed,
        "errors": sum(1 for r in requests if r.get("error") is not None),
        "good": good,
        "attainment": good / len(requests),
        "span_s": span,
        "throughput_rps": completed / span if span > 0 else 0.0,
        "goodput_rps": good / span if span > 0 else 0.0,
        "ttft_mean_ms": _ms(statistics.fmean(ttft)) if ttft else None,
        "ttft_p50_ms": _ms(percentile(ttft, 50)),
        "ttft_p90_ms": _ms(percentile(ttft, 90)),
        # P99 only over 100 requests and more (core.slo.tail); the max always.
        "ttft_p99_ms": _p99_ms(ttft),
        "ttft_max_ms": _ms(max(ttft, default=None)),
        "tpot_p50_ms": _ms(percentile(tpot, 50)),
        "tpot_p90_ms": _ms(percentile(tpot, 90)),
        "after_p_n": len(after_p),
        "after_p_p50_ms": _ms(percentile(after_p, 50)),
        "after_p_p90_ms": _ms(percentile(after_p, 90)),
        "after_p_p99_ms": _p99_ms(after_p),
        "after_p_max_ms": _ms(max(after_p, default=None)),
        "ttft_ok_share": sum(j["ttft_ok"] for j in judged) / len(requests),
        "tpot_ok_share": sum(j["tpot_ok"] for j in judged) / len(requests),
    }


def knee(points: Iterable[tuple[float, float]], threshold: float = ATTAINMENT) -> float | None:
    """The highest rate whose attainment (share of requests meeting the SLO) is ≥ ``threshold``;
    None when no rate reached it."""
    ok = [rate for rate, attained in points if attained >= threshold]
    return max(ok) if ok else None


def knee_ratio(mine: float | None, peer: float | None) -> float | None:
    return mine / peer if mine is not None and peer is not None and peer > 0 else None


def handoff_ms(ttft_ms: float | None, p_prefill_ms: float | None) -> float | None:
    """What the P/D handoff adds to TTFT: TTFT − P's own forward (prefill) time, per request."""
    if ttft_ms is None or p_prefill_ms is None or not math.isfinite(p_prefill_ms):
        return None
    return ttft_ms - p_prefill_ms


def link_calibration(unloaded: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """``bench pd``'s shaped rate (``core.stats.calibrate_link``) from the unloaded run: per
    prompt length, KV bytes and P's prefill time over the answered requests of both systems."""
    return calibrate_link(
        {
            "workload": str(r["prompt_tokens"]),
            "concurrency": 1,
            "counted": r["error"] is None and r["bytes"] > 0,
            "bytes": r["bytes"],
            "p_prefill_ms": 1e3 * r["p_prefill_s"],
        }
        for r in unloaded
    )


# Per rate and system, in the order the table shows them (``summarize_steps``).
FIGURES = (
    "ttft_p50_ms",
    "ttft_p90_ms",
    "ttft_p99_ms",
    "ttft_max_ms",
    "handoff_ms",
    "after_p_p50_ms",
    "after_p_p99_ms",
    "after_p_max_ms",
    "layer_write_ms",
    "tpot_p50_ms",
    "tpot_p90_ms",
    "throughput_rps",
    "goodput_rps",
    "attainment",
    "p_queue_ms",
    "p_prefill_ms",
    "d_kv_usage_max",
    "d_waiting_max",
    "preemptions",
    "failed_loads_est",
    "transfers_failed",
    "transfer_cpu_ms",
    "cpu_ms_per_request",
    "transfer_rss_mib",
)


def summarize_steps(
    steps: Sequence[Mapping[str, Any]],
    systems: Sequence[str],
    aa: tuple[str, str] | None = None,
) -> dict[str, Any]:
    """Per (rate, system): min, median and max of every figure over the reps (n); each
    system's knee from its median attainment per rate, ``knee_ratio`` = first system's knee /
    second's; with ``aa`` = (system, its second pass), the ratio of their medians per figure at
    the rate both ran (the noise floor)."""
    names = list(dict.fromkeys([*systems, *(aa or ())]))
    rows: list[dict[str, Any]] = []
    for rate in sorted({float(st["rate"]) for st in steps}):
        for name in names:
            mine = [st for st in steps if st["rate"] == rate and st["system"] == name]
            if mine:
                row: dict[str, Any] = {"rate": rate, "system": name, "reps": len(mine)}
                for f in FIGURES:
                    vals = [float(st[f]) for st in mine if st.get(f) is not None]
                    row[f] = spread(vals)
                rows.append(row)

    def median(rate: float, name: str, f: str) -> float | None:
        row = next((r for r in rows if r["rate"] == rate and r["system"] == name), None)
        return None if row is None else row[f]["median"]

    knees: dict[str, float | None] = {}
    for name in systems:
        pts = [(r["rate"], r["attainment"]["median"]) for r in rows if r["system"] == name]
        knees[name] = knee((rate, a) for rate, a in pts if a is not None)
    out: dict[str, Any] = {
        "rows": rows,
        "knee": knees,
        "knee_ratio": knee_ratio(knees[systems[0]], knees[systems[1]]),
        "aa": None,
    }
    if aa is not None:
        rates = [r["rate"] for r in rows if r["system"] == aa[1]]
        out["aa"] = [
            {
                "rate": rate,
                "systems": list(aa),
                "ratio": {
                    f: knee_ratio(median(rate, aa[0], f), median(rate, aa[1], f)) for f in FIGURES
                },
            }
            for rate in rates
        ]
    return out
