"""Pure logic of ``bench soak``: whether the transfer path's processes stay flat after warm-up
(RSS, open descriptors, threads), and whether every request ended once on both sidecars."""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from app.errors import ConfigError

METRICS = ("rss_mib", "fds", "threads")
GROWTH_LIMIT = 1.10  # issue 36: "flat after warm-up (<= +10%)"


def growth(
    samples: Sequence[Mapping[str, Any]], warmup_s: float, base_s: float, end_s: float
) -> dict[str, dict[str, float]]:
    """Per ``process/metric``: the baseline (median of the samples in the ``base_s`` after
    warm-up), the late level (median of those in the last ``base_s`` before the load ended at
    ``end_s``), the highest after warm-up, and ``ratio`` = late / baseline. Medians, as open
    descriptors and threads follow the requests in flight at a sample: a leak is a level that
    climbs, not one busy moment. Each sample is ``{"t": seconds from the load's start,
    "usage": {process: {metric: value}}}``."""
    after = [s for s in samples if warmup_s <= s["t"] <= end_s]
    base = [s for s in after if s["t"] < warmup_s + base_s]
    late = [s for s in after if s["t"] > end_s - base_s]
    if not base or not late or end_s - base_s < warmup_s + base_s:
        raise ConfigError(
            f"usage samples between {warmup_s:g} s and {warmup_s + base_s:g} s and in the "
            f"last {base_s:g} s before {end_s:g} s: expected a load longer than warm-up and "
            "two baseline windows, sampled more often than the window"
        )
    out: dict[str, dict[str, float]] = {}
    for proc in base[0]["usage"]:
        for m in METRICS:
            b, end = _level(base, proc, m), _level(late, proc, m)
            out[f"{proc}/{m}"] = {
                "base": b,
                "late": end,
                "max": max(float(s["usage"][proc][m]) for s in after if proc in s["usage"]),
                "ratio": end / b if b > 0 else (1.0 if end == 0 else float("inf")),
            }
    return out


def _level(rows: Sequence[Mapping[str, Any]], proc: str, metric: str) -> float:
    return statistics.median(float(s["usage"][proc][metric]) for s in rows if proc in s["usage"])


def grew(figures: Mapping[str, Mapping[str, float]], limit: float = GROWTH_LIMIT) -> list[str]:
    """The ``process/metric`` names whose late level passed ``limit`` x their baseline."""
    return sorted(k for k, f in figures.items() if f["ratio"] > limit)


def labelled(text: str, name: str) -> dict[str, float]:
    """One metric of a Prometheus page, by its label set (``side=send,state=DONE``, labels in
    name order); a counter's ``_total`` sample counts, its ``_created`` does not."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in (name, f"{name}_total"):
                key = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
                out[key] = out.get(key, 0.0) + sample.value
    return out


def delta(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    """What each counter gained in between (label sets absent before counted from 0)."""
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}


def ended_once(
    p_ended: Mapping[str, float],
    d_ended: Mapping[str, float],
    p_live: Mapping[str, float],
    d_live: Mapping[str, float],
    transfers: Mapping[str, float],
) -> list[str]:
    """What is wrong with the sidecars' accounting of the proxy's transfers (``transfers``: its
    final status counts, ``outcome=ok`` and others). Each ``ok`` transfer must have ended DONE
    as a send on P and a recv on D; every other one ended once on D, in another state (the
    proxy told decode to stop), and at most once on P (a prefill that failed may have no send);
    none may still be in flight. Empty when all is well."""
    ok = sum(v for k, v in transfers.items() if k == "outcome=ok")
    other = sum(v for k, v in transfers.items() if k != "outcome=ok")
    problems = []
    for side, ended, live in (("send", p_ended, p_live), ("recv", d_ended, d_live)):
        mine = {k: v for k, v in ended.items() if f"side={side}" in k}
        done = sum(v for k, v in mine.items() if k.endswith("state=DONE"))
        rest = sum(v for k, v in mine.items() if not k.endswith("state=DONE"))
        if done != ok:
            problems.append(f"{side}: {done:g} ended DONE, expected {ok:g} (the proxy's ok)")
        if rest > other or (side == "recv" and rest != other):
            want = f"{other:g}" if side == "recv" else f"at most {other:g}"
            problems.append(
                f"{side}: {rest:g} ended other than DONE, expected {want} (the proxy's others)"
            )
        stuck = {k: v for k, v in live.items() if f"side={side}" in k and v}
        if stuck:
            problems.append(f"{side}: still in flight after the drain: {stuck}")
    return problems
