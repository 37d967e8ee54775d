"""The SLO of the runs under load (``bench load``, ``bench faults``, ``bench soak``), pure: the
SLO from the unloaded run, each request's timings judged against it, percentiles, vLLM gauges
and counters read from the metrics text."""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

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


# Under 100 samples the 99th percentile is the largest one or an interpolation to it: a
# "P99" there says what one request did, so it is written and printed as the max.
TAIL_MIN_SAMPLES = 100


def tail_label(n: int) -> str:
    """What the tail figure over ``n`` samples is called: ``p99`` from 100 samples, else
    ``max``."""
    return "p99" if n >= TAIL_MIN_SAMPLES else "max"


def tail(values: Iterable[float]) -> tuple[str, float | None]:
    """The tail figure of ``values`` and its name: (``p99``, P99) over at least 100 samples,
    else (``max``, the maximum); (``max``, None) when empty."""
    vs = [v for v in values if v == v]
    label = tail_label(len(vs))
    return label, (percentile(vs, 99) if label == "p99" else max(vs, default=None))


def named_tail(p99: float | None, largest: float | None) -> tuple[str, float | None]:
    """A report's tail figure from a result that wrote ``p99`` only over 100 samples (None
    below) and the max always: (``p99``, P99) or (``max``, the max)."""
    return ("p99", p99) if p99 is not None else ("max", largest)


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
