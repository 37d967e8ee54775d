"""Pure logic of ``bench pd`` on top of ``core.stats``: workloads, trial order, the per-metric
summary with its paired ratios and A/A."""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from app.bench.core.bootstrap import paired_interval
from app.bench.core.stats import spread
from app.errors import ConfigError

# Per-trial metrics, in the order the table shows them; "bytes" is per trial (all its prompts).
METRICS = (
    "ttft_ms",
    "p_start_ms",
    "p_prefill_ms",
    "exposed_ms",
    "exposed_d_done_ms",
    "exposed_after_forward_ms",
    "layer_write_ms",
    "exposed_derived_ms",
    "bytes",
    "transfer_cpu_ms",
    "cpu_ms_per_request",
    "cpu_s_per_gib",
    "handoff_ms",
    "d_first_step_ms",
    "sidecar_p_peak_rss_mib",
    "sidecar_d_peak_rss_mib",
    "shm_mib",
    "pinned_ms",
)


# Observed on kv-sidecar only (its per-layer timeline): Mooncake's connector has no per-layer
# writes, no view of P's forward, no sidecars and no record of D's blocks pinned.
SIDECAR_ONLY = (
    "exposed_after_forward_ms",
    "layer_write_ms",
    "sidecar_p_peak_rss_mib",
    "sidecar_d_peak_rss_mib",
    "pinned_ms",
)


@dataclass(frozen=True)
class Workload:
    """``concurrency`` prompts of ``tokens`` tokens each, sent at once."""

    tokens: int
    concurrency: int = 1

    @property
    def name(self) -> str:
        size = f"{self.tokens // 1024}k" if self.tokens % 1024 == 0 else str(self.tokens)
        return size if self.concurrency == 1 else f"{self.concurrency}x{size}"


@dataclass(frozen=True)
class Trial:
    rep: int
    workload: Workload
    system: str


def parse_tokens(text: str) -> int:
    """``512``, ``2k`` (2048) or ``8K``."""
    t = text.strip().lower()
    try:
        return int(t[:-1]) * 1024 if t.endswith("k") else int(t)
    except ValueError as e:
        raise ConfigError(f"prompt size {text!r}: expected a token count such as 512 or 2k") from e


def parse_workloads(sizes: str, concurrent: str) -> tuple[Workload, ...]:
    """``--sizes 512,2k,8k`` and ``--concurrent 4x2k`` (empty: none)."""
    out = [Workload(parse_tokens(s)) for s in sizes.split(",") if s.strip()]
    for item in (c for c in concurrent.split(",") if c.strip()):
        n, sep, size = item.lower().partition("x")
        if not sep or not n.strip().isdigit() or int(n) < 1:
            raise ConfigError(f"--concurrent {item!r}: expected COUNTxTOKENS such as 4x2k")
        out.append(Workload(parse_tokens(size), int(n)))
    if not out:
        raise ConfigError("no workload: give --sizes and/or --concurrent")
    return tuple(out)


def trial_order(workloads: Sequence[Workload], systems: Sequence[str], reps: int) -> list[Trial]:
    """Systems alternate trial by trial; the order they start in rotates every workload and
    every repetition, so neither system always runs first (after an idle engine) or second."""
    out: list[Trial] = []
    for rep in range(reps):
        for i, w in enumerate(workloads):
            k = (rep + i) % len(systems)
            out.extend(Trial(rep, w, s) for s in (*systems[k:], *systems[:k]))
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    # A ratio of negative times (KV at D before P's answer) would read backwards.
    return a / b if a is not None and b is not None and a > 0 and b > 0 else None


def paired_ratios(mine: Sequence[Mapping[str, Any]], a: str, b: str, metric: str) -> list[float]:
    """``a``'s value over ``b``'s, per repetition where both trials counted: the spread of the
    ratio itself, not only the ratio of the medians."""

    va, vb = _by_rep(mine, a, metric), _by_rep(mine, b, metric)
    ratios = (_ratio(va[rep], vb[rep]) for rep in sorted(va.keys() & vb.keys()))
    return [r for r in ratios if r is not None]


def summarize(
    trials: Sequence[Mapping[str, Any]],
    systems: Sequence[str],
    aa: tuple[str, str] | None = None,
) -> list[dict[str, Any]]:
    """Per (link, workload, metric): each system's min, median and max over its counted trials,
    with n; the ratio first system / second (of the medians, and its spread over paired
    repetitions); with ``aa`` = (system, its second measurement pass), the same ratio of one
    system against itself: the noise floor."""
    names = list(dict.fromkeys([*systems, *(aa or ())]))
    rows: list[dict[str, Any]] = []
    keys = dict.fromkeys((t["link"], t["workload"]) for t in trials)
    for link, workload in keys:
        mine = [t for t in trials if t["link"] == link and t["workload"] == workload]
        for metric in METRICS:
            row: dict[str, Any] = {"link": link, "workload": workload, "metric": metric}
            row["spread"] = {}
            for s in names:
                sp = spread(t[metric] for t in mine if t["system"] == s and t["counted"])
                row["spread"][s] = sp
                row[s] = sp["median"]  # the figure; the spread says how far to trust it
                row[f"{s}_n"] = sum(1 for t in mine if t["system"] == s and t["counted"])
            a, b = systems[0], systems[1]
            row["ratio"] = _ratio(row[a], row[b])
            row["ratio_spread"] = spread(paired_ratios(mine, a, b, metric))
            row["ratio_interval"] = _interval(mine, a, b, metric, "ratio")
            row["aa"] = None
            if aa is not None:
                row["aa"] = {
                    "systems": list(aa),
                    "ratio": _ratio(row[aa[0]], row[aa[1]]),
                    "ratio_spread": spread(paired_ratios(mine, aa[0], aa[1], metric)),
                    "ratio_interval": _interval(mine, aa[0], aa[1], metric, "ratio"),
                }
            rows.append(row)
    return rows


# ``--digest``'s comparisons: the handoff as a difference (the issue's bound is in ms), the
# transfer path's CPU per GB as a ratio (its bound is a share).
DIGEST_FIGURES = {"handoff_ms": "difference", "cpu_s_per_gib": "ratio"}


def against_base(
    trials: Sequence[Mapping[str, Any]], base: str, others: Sequence[str]
) -> list[dict[str, Any]]:
    """Per (link, workload, system of ``others``, figure of ``DIGEST_FIGURES``): its median less
    (or over) ``base``'s, with a 90% bootstrap interval over repetitions resampled in pairs (a
    repetition's trials of every system ran back to back)."""
    rows: list[dict[str, Any]] = []
    for link, workload in dict.fromkeys((t["link"], t["workload"]) for t in trials):
        mine = [t for t in trials if t["link"] == link and t["workload"] == workload]
        for other in others:
            for metric, how in DIGEST_FIGURES.items():
                rows.append(
                    {
                        "link": link,
                        "workload": workload,
                        "system": other,
                        "base": base,
                        "metric": metric,
                        "how": how,
                        "interval": _interval(mine, other, base, metric, how),
                    }
                )
    return rows


def _interval(
    mine: Sequence[Mapping[str, Any]], a: str, b: str, metric: str, how: str
) -> dict[str, Any] | None:
    """``a``'s median over (``how`` "ratio") or less ("difference") ``b``'s, with its 90%
    bootstrap interval over repetitions resampled in pairs (a repetition's trials of every
    system ran back to back); None when no repetition has both."""
    va, vb = _by_rep(mine, a, metric), _by_rep(mine, b, metric)

    def stat(reps: Sequence[int]) -> float | None:
        x = statistics.median(va[r] for r in reps)
        y = statistics.median(vb[r] for r in reps)
        return x - y if how == "difference" else _ratio(x, y)

    iv = paired_interval(sorted(va.keys() & vb.keys()), stat)
    return iv.as_dict() if iv is not None else None


def _by_rep(mine: Sequence[Mapping[str, Any]], system: str, metric: str) -> dict[int, float]:
    return {t["rep"]: float(t[metric]) for t in mine if t["counted"] and t["system"] == system}
