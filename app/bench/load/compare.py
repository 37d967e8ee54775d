"""``bench load``'s comparisons over a rung's rounds (issue 52, items 2 and 3), pure.

Every system runs each rung's requests in ``rounds`` interleaved blocks (``core.interleave``):
the same seeded requests in every round and for every system. So a request index is the unit
both systems (and both rounds of one system) share: the ratios' intervals are paired bootstrap
intervals over request indices (``core.bootstrap``), each index's answers of every round
drawn together. Per rate: the figures pooled over the rounds, each ratio kv-sidecar / peer with
its interval, each system's A/A (round 2 / round 1, the same work apart in time), and per
system the drift between rounds; over the ladder, the knee ratio's interval.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from app.bench.core.bootstrap import Interval, paired_interval
from app.bench.core.slo import Slo, judge, percentile, timings
from app.bench.load.stats import knee, knee_ratio, step_figures

Step = Mapping[str, Any]
# Per request index, one judged answer per round: what a bootstrap draw picks together.
ByIndex = dict[int, list[dict[str, Any]]]


def answers(step: Step) -> list[dict[str, Any]]:
    """A step's stored requests as ``judge`` reads them (the JSON keeps a token count)."""
    out = []
    for r in step["requests"]:
        n = r.get("tokens")
        out.append(dict(r) | {"tokens": range(n) if isinstance(n, int) else n})
    return out


def _judged(steps: Sequence[Step], slo: Slo) -> ByIndex:
    by: ByIndex = {}
    for st in steps:
        for a in answers(st):
            by.setdefault(int(a["index"]), []).append(judge(a, slo))
    return by


def _pick(by: ByIndex, pick: Sequence[int], key: str) -> list[float]:
    return [j[key] for i in pick for j in by.get(i, ()) if j[key] is not None]


def _p(q: float) -> Callable[[Sequence[float]], float | None]:
    return lambda vs: percentile(vs, q)


def _over(
    by: ByIndex, pick: Sequence[int], key: str, stat: Callable[[Sequence[float]], float | None]
) -> float | None:
    vs = _pick(by, pick, key)
    return stat(vs) if vs else None


def _div(x: float | None, y: float | None) -> float | None:
    return x / y if x is not None and y is not None and y != 0 else None


def _mean_or_none(vs: Sequence[float]) -> float | None:
    return statistics.fmean(vs) if vs else None


def _rate(by: ByIndex, pick: Sequence[int], span_s: float) -> float | None:
    """Good requests per second of the rounds' summed spans (goodput), over the picked indices."""
    return sum(j["good"] for i in pick for j in by.get(i, ())) / span_s if span_s > 0 else None


def _p_prefill_ms(steps: Sequence[Step]) -> float | None:
    vs = [float(s["p_prefill_ms"]) for s in steps if s.get("p_prefill_ms") is not None]
    vs = [v for v in vs if math.isfinite(v)]
    return _mean_or_none(vs)


def ratios(
    a: Sequence[Step], b: Sequence[Step], slo: Slo, seed: int = 0
) -> dict[str, dict[str, Any] | None]:
    """A's figure / B's, pooled over their rounds, each with its paired 90% interval: TTFT
    P50 and P90, TPOT P50, handoff (mean TTFT − P's mean prefill) and goodput."""
    ja, jb = _judged(a, slo), _judged(b, slo)
    units = sorted(set(ja) & set(jb))
    span_a = sum(float(s["span_s"]) for s in a)
    span_b = sum(float(s["span_s"]) for s in b)
    pa, pb = _p_prefill_ms(a), _p_prefill_ms(b)

    def of(key: str, stat: Callable[[Sequence[float]], float | None]) -> Callable[..., Any]:
        return lambda pick: _div(_over(ja, pick, key, stat), _over(jb, pick, key, stat))

    def handoff(pick: Sequence[int]) -> float | None:
        ta, tb = _over(ja, pick, "ttft_s", _mean_or_none), _over(jb, pick, "ttft_s", _mean_or_none)
        if ta is None or tb is None or pa is None or pb is None:
            return None
        return _div(1e3 * ta - pa, 1e3 * tb - pb)

    stats: dict[str, Callable[[Sequence[int]], float | None]] = {
        "ttft_p50_ms": of("ttft_s", _p(50)),
        "ttft_p90_ms": of("ttft_s", _p(90)),
        "tpot_p50_ms": of("tpot_s", _p(50)),
        "handoff_ms": handoff,
        "goodput_rps": lambda pick: _div(_rate(ja, pick, span_a), _rate(jb, pick, span_b)),
    }
    return {k: _as_dict(paired_interval(units, f, seed=seed)) for k, f in stats.items()}


def _as_dict(iv: Interval | None) -> dict[str, Any] | None:
    return None if iv is None else iv.as_dict()


def ttft_interval(a: Sequence[Step], b: Sequence[Step], q: float) -> Interval | None:
    """A's TTFT ``q``-th percentile / B's over their steps' requests, paired over request
    indices (no SLO needed: for the docs' tables of runs that ran a rate once)."""
    ta, tb = (_ttfts(steps) for steps in (a, b))
    units = sorted(set(ta) & set(tb))

    def ratio(pick: Sequence[int]) -> float | None:
        xa = [t for i in pick for t in ta[i]]
        xb = [t for i in pick for t in tb[i]]
        return _div(percentile(xa, q), percentile(xb, q))

    return paired_interval(units, ratio)


def _ttfts(steps: Sequence[Step]) -> dict[int, list[float]]:
    out: dict[int, list[float]] = {}
    for st in steps:
        for a in answers(st):
            if (t := timings(a)["ttft_s"]) is not None:
                out.setdefault(int(a["index"]), []).append(t)
    return out


def pooled(steps: Sequence[Step], slo: Slo) -> dict[str, Any]:
    """One system's figures at one rate over all its rounds' requests; throughput and goodput
    per second of the rounds' summed spans (the pause between rounds is no one's time)."""
    figs = step_figures([a for st in steps for a in answers(st)], slo)
    span = sum(float(s["span_s"]) for s in steps)
    figs |= {
        "rounds": len(steps),
        "span_s": span,
        "throughput_rps": figs["completed"] / span if span > 0 else 0.0,
        "goodput_rps": figs["good"] / span if span > 0 else 0.0,
    }
    p = _p_prefill_ms(steps)
    figs["handoff_ms"] = (
        None if figs["ttft_mean_ms"] is None or p is None else figs["ttft_mean_ms"] - p
    )
    return figs


def by_round(steps: Sequence[Step]) -> dict[int, list[Step]]:
    out: dict[int, list[Step]] = {}
    for st in steps:
        out.setdefault(int(st.get("round", st.get("rep", 0))), []).append(st)
    return dict(sorted(out.items()))


def drift(rows: Sequence[Mapping[str, Any]]) -> dict[str, list[float | None]]:
    """Per system, each round's TTFT P50 over its first round's, the geometric mean over the
    rates (1.0 for the first round): the host's drift between rounds, which ABBA spreads over
    every system alike."""
    out: dict[str, list[float | None]] = {}
    for system in dict.fromkeys(r["system"] for r in rows):
        mine = [r["round_ttft_p50_ms"] for r in rows if r["system"] == system]
        n = max((len(m) for m in mine), default=0)
        col: list[float | None] = []
        for k in range(n):
            logs = [
                math.log(m[k] / m[0])
                for m in mine
                if len(m) > k and m[0] and m[k] and m[0] > 0 and m[k] > 0
            ]
            col.append(math.exp(statistics.fmean(logs)) if logs else None)
        out[system] = col
    return out


def compare(
    steps: Sequence[Step], systems: Sequence[str], slo: Slo, seed: int = 0
) -> dict[str, Any]:
    """The rounds' summary: per rate and system the pooled figures and each round's TTFT P50;
    per rate kv-sidecar / peer with intervals and every system's A/A (round 2 / round 1); the
    knees from pooled attainment, their ratio with its interval; the drift between rounds."""
    rates = sorted({float(st["rate"]) for st in steps})
    at = {
        (rate, name): [s for s in steps if float(s["rate"]) == rate and s["system"] == name]
        for rate in rates
        for name in systems
    }
    rows: list[dict[str, Any]] = []
    for (rate, name), mine in at.items():
        if not mine:
            continue
        rounds = by_round(mine)
        row = {"rate": rate, "system": name} | pooled(mine, slo)
        row["round_ttft_p50_ms"] = [pooled(rs, slo)["ttft_p50_ms"] for rs in rounds.values()]
        rows.append(row)
    a, b = systems[0], systems[1]
    per_rate = []
    for rate in rates:
        entry: dict[str, Any] = {"rate": rate}
        if at[(rate, a)] and at[(rate, b)]:
            entry["ratio"] = ratios(at[(rate, a)], at[(rate, b)], slo, seed)
        entry["aa"] = {}
        for name in systems:
            blocks = list(by_round(at[(rate, name)]).values())
            if len(blocks) >= 2:
                entry["aa"][name] = ratios(blocks[1], blocks[0], slo, seed)
        per_rate.append(entry)
    knees = {
        name: knee((r["rate"], r["attainment"]) for r in rows if r["system"] == name)
        for name in systems
    }
    return {
        "rows": rows,
        "per_rate": per_rate,
        "knee": knees,
        "knee_ratio": _as_dict(knee_interval(at, rates, a, b, slo, seed)),
        "drift": drift(rows),
    }


def knee_interval(
    at: Mapping[tuple[float, str], Sequence[Step]],
    rates: Sequence[float],
    a: str,
    b: str,
    slo: Slo,
    seed: int = 0,
) -> Interval | None:
    """A's knee / B's and its interval: a draw picks request indices once for every rung (one
    seed: index i is the same request at every rate), each rung's attainment then per system."""
    judged = {k: _judged(v, slo) for k, v in at.items()}
    units = sorted({i for by in judged.values() for i in by})

    def ratio(pick: Sequence[int]) -> float | None:
        def knee_of(name: str) -> float | None:
            pts = []
            for rate in rates:
                good = _pick(judged[(rate, name)], pick, "good")
                if good:
                    pts.append((rate, sum(good) / len(good)))
            return knee(pts)

        return knee_ratio(knee_of(a), knee_of(b))

    return paired_interval(units, ratio, seed=seed)
