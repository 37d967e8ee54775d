"""Pure logic of ``bench load``: the SLO from the unloaded run, each request judged against it,
a rate step's percentiles, throughput and goodput, the knee, vLLM gauges and counters."""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from app.bench.core.stats import calibrate_link, spread
from app.errors import ConfigError

ATTAINMENT = 0.9  # the knee: the highest rate where this share of requests met the SLO


def percentile(values: Iterable[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100), linear between order statistics; None if empty."""
    vs = sorted(v for v in values if v == v)
    if not vs:
        return None
    pos = (len(vs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(vs) - 1)
    return vs[lo] + (vs[hi] - vs[lo]) * (pos - lo)


def fit_line(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Least squares ``y = a + b x`` (b = 0 when every x is the same); b is kept ≥ 0, as a
    longer prompt never prefills faster."""
    if not points:
        raise ConfigError("no unloaded request to derive the SLO from")
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = max(0.0, sum((x - mx) * (y - my) for x, y in points) / sxx) if sxx > 0 else 0.0
    return my - b * mx, b


@dataclass(frozen=True)
class SloFactors:
    """The SLO's multiples of the unloaded run: TTFT ≤ ``ttft`` x prefill + ``ttft_slack_s``,
    TPOT ≤ ``tpot`` x the unloaded TPOT (issue 36's defaults)."""

    ttft: float = 2.0
    ttft_slack_s: float = 0.1
    tpot: float = 1.5

    def __post_init__(self) -> None:
        if not (self.ttft >= 1 and self.tpot >= 1 and self.ttft_slack_s >= 0):
            raise ConfigError(
                f"SLO factors ttft {self.ttft}, tpot {self.tpot}, slack {self.ttft_slack_s} s: "
                "expected both factors >= 1 (the unloaded figure itself) and slack >= 0"
            )


@dataclass(frozen=True)
class Slo:
    """TTFT ≤ ``ttft_factor`` x unloaded prefill(prompt) + ``ttft_slack_s``; TPOT ≤
    ``tpot_factor`` x unloaded TPOT. Prefill(n) = ``prefill_a_s`` + ``prefill_b_s`` x n."""

    prefill_a_s: float
    prefill_b_s: float
    tpot_s: float
    ttft_factor: float = SloFactors.ttft
    ttft_slack_s: float = SloFactors.ttft_slack_s
    tpot_factor: float = SloFactors.tpot

    def prefill_s(self, tokens: int) -> float:
        return max(0.0, self.prefill_a_s + self.prefill_b_s * tokens)

    def ttft_limit_s(self, tokens: int) -> float:
        return self.ttft_factor * self.prefill_s(tokens) + self.ttft_slack_s

    @property
    def tpot_limit_s(self) -> float:
        return self.tpot_factor * self.tpot_s

    def describe(self) -> str:
        a, b = 1e3 * self.prefill_a_s, 1e6 * self.prefill_b_s
        return (
            f"SLO: TTFT <= {self.ttft_factor:g} x unloaded prefill + "
            f"{1e3 * self.ttft_slack_s:.0f} ms, prefill = {a:.1f} ms + {b:.2f} us/token "
            f"(1k tokens: TTFT <= {1e3 * self.ttft_limit_s(1024):.0f} ms); TPOT <= "
            f"{self.tpot_factor:g} x {1e3 * self.tpot_s:.1f} ms = {1e3 * self.tpot_limit_s:.1f} ms"
        )

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {"tpot_limit_s": self.tpot_limit_s, "text": self.describe()}


def derive_slo(unloaded: Sequence[Mapping[str, Any]], factors: SloFactors | None = None) -> Slo:
    """The SLO from unloaded requests (both systems: one SLO for both), each with
    ``prompt_tokens``, ``p_prefill_s`` (P's own prefill time) and ``tpot_s``."""
    points = [
        (float(r["prompt_tokens"]), float(r["p_prefill_s"]))
        for r in unloaded
        if r.get("p_prefill_s") is not None and math.isfinite(r["p_prefill_s"])
    ]
    a, b = fit_line(points)
    tpots = [float(r["tpot_s"]) for r in unloaded if r.get("tpot_s") is not None]
    if not tpots:
        raise ConfigError("no unloaded request gave a TPOT to derive the SLO from")
    f = factors or SloFactors()
    return Slo(a, b, statistics.median(tpots), f.ttft, f.ttft_slack_s, f.tpot)


def timings(r: Mapping[str, Any]) -> dict[str, float | None]:
    """A request's TTFT, TPOT and end-to-end time (s) from its send, first and last token
    times and its token count; None where it did not get that far."""
    sent, first, last, n = r["sent"], r.get("first"), r.get("last"), len(r.get("tokens") or ())
    return {
        "ttft_s": first - sent if first is not None else None,
        "tpot_s": (last - first) / (n - 1)
        if first is not None and last is not None and n > 1
        else None,
        "e2e_s": last - sent if last is not None else None,
    }


def judge(r: Mapping[str, Any], slo: Slo) -> dict[str, Any]:
    """One request against the SLO: it completed (every asked token, no error) and met both the
    TTFT and the TPOT limit; a request with one output token has no TPOT to miss."""
    t = timings(r)
    done = r.get("error") is None and len(r.get("tokens") or ()) == r["max_tokens"]
    ttft_ok = t["ttft_s"] is not None and t["ttft_s"] <= slo.ttft_limit_s(r["prompt_tokens"])
    tpot_ok = done and (t["tpot_s"] is None or t["tpot_s"] <= slo.tpot_limit_s)
    return t | {
        "completed": done,
        "ttft_ok": ttft_ok,
        "tpot_ok": tpot_ok,
        "good": done and ttft_ok and tpot_ok,
    }


def _ms(v: float | None) -> float | None:
    return None if v is None else 1e3 * v


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
        "ttft_p99_ms": _ms(percentile(ttft, 99)),
        "tpot_p50_ms": _ms(percentile(tpot, 50)),
        "tpot_p90_ms": _ms(percentile(tpot, 90)),
        "after_p_n": len(after_p),
        "after_p_p50_ms": _ms(percentile(after_p, 50)),
        "after_p_p90_ms": _ms(percentile(after_p, 90)),
        "after_p_p99_ms": _ms(percentile(after_p, 99)),
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


def parse_metrics(text: str, names: Sequence[str]) -> dict[str, float | None]:
    """Each named gauge or counter of a Prometheus page, summed over its label sets (a
    counter ``X`` is exposed as ``X_total``); None when the page has no such line."""
    out: dict[str, float | None] = {}
    for name in names:
        vals = [
            float(m.group(1))
            for m in re.finditer(
                rf"^{re.escape(name)}(?:_total)?(?:\{{[^}}]*\}})? (\S+)$", text, re.M
            )
        ]
        out[name] = sum(vals) if vals else None
    return out


def series_figures(samples: Sequence[Mapping[str, Any]], key: str) -> dict[str, float | None]:
    """Mean and max of one sampled gauge over a step."""
    vs = [float(s[key]) for s in samples if s.get(key) is not None]
    return {"mean": statistics.fmean(vs) if vs else None, "max": max(vs) if vs else None}


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
    "handoff_ms",
    "after_p_p50_ms",
    "after_p_p99_ms",
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
