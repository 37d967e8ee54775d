"""Pure logic the real-engine benches share: the systems' names, link rate, histograms,
references, failed loads, engine steps, spreads and quantiles."""

from __future__ import annotations

import itertools
import math
import re
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from app.errors import ConfigError

SIDECAR, MOONCAKE = "kv-sidecar", "mooncake"
SYSTEMS = (SIDECAR, MOONCAKE)
TRANSFER_SHARE = 0.25  # default rate: the transfer takes this share of P's prefill time
_HISTOGRAMS = (
    "vllm:e2e_request_latency_seconds",
    "vllm:request_inference_time_seconds",
    "vllm:request_prefill_time_seconds",
)


def link_rate_bps(kv_bytes: float, prefill_s: float, share: float = TRANSFER_SHARE) -> float:
    """The rate at which ``kv_bytes`` take ``share`` of ``prefill_s``: bytes·8 / (share·prefill)."""
    if kv_bytes <= 0 or prefill_s <= 0:
        raise ConfigError("calibration saw no bytes or no prefill time; give --rate")
    return kv_bytes * 8 / (share * prefill_s)


def default_burst(rate_bps: float) -> int:
    """5 ms at the rate, at least 128 KiB (a loopback packet is up to 64 KiB; a smaller bucket
    would drop every full-sized one)."""
    return max(128 << 10, int(rate_bps / 8 * 0.005))


def parse_rate(text: str) -> float:
    """``800mbit``, ``1.5gbit``, ``200kbit`` or bits/s as a number."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([kmg]?)(bit|bps)?\s*", text.lower())
    if not m:
        raise ConfigError(f"--rate {text!r}: expected e.g. 800mbit, 1.5gbit or bits per second")
    return float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)]


def parse_size(text: str) -> int:
    """``256kb``, ``1mb`` or bytes as a number (tc's units: kb = 1024 bytes)."""
    m = re.fullmatch(r"\s*([0-9]+)\s*([kmg]?)b?\s*", text.lower())
    if not m:
        raise ConfigError(f"--burst {text!r}: expected e.g. 256kb, 1mb or bytes")
    return int(m.group(1)) << {"": 0, "k": 10, "m": 20, "g": 30}[m.group(2)]


def calibrate_link(trials: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """The shaped rate from unshaped trials: per single-prompt workload, the median KV bytes and
    P prefill time over both systems give bytes·8 / (0.25·prefill); the rate is the median of
    those over workloads."""
    rows: dict[str, dict[str, list[float]]] = {}
    for t in trials:
        if t["concurrency"] != 1 or not t["counted"]:
            continue
        r = rows.setdefault(t["workload"], {"bytes": [], "prefill_s": []})
        r["bytes"].append(float(t["bytes"]))
        r["prefill_s"].append(float(t["p_prefill_ms"]) / 1e3)
    per = {
        w: {
            "bytes": statistics.median(v["bytes"]),
            "prefill_s": statistics.median(v["prefill_s"]),
        }
        for w, v in rows.items()
    }
    for v in per.values():
        v["rate_bps"] = link_rate_bps(v["bytes"], v["prefill_s"])
    if not per:
        raise ConfigError("the calibration run had no counted single-prompt trial; give --rate")
    rate = statistics.median(v["rate_bps"] for v in per.values())
    return {"share": TRANSFER_SHARE, "per_workload": per, "rate_bps": rate}


def parse_histograms(metrics_text: str) -> dict[str, tuple[float, float]]:
    """(sum, count) of the request-time histograms in a vLLM ``/metrics`` page."""
    out: dict[str, tuple[float, float]] = {}
    for name in _HISTOGRAMS:
        total = count = 0.0
        for kind in ("sum", "count"):
            for m in re.finditer(
                rf"^{re.escape(name)}_{kind}(?:\{{[^}}]*\}})? (\S+)$", metrics_text, re.M
            ):
                if kind == "sum":
                    total += float(m.group(1))
                else:
                    count += float(m.group(1))
        out[name] = (total, count)
    return out


def p_times(
    before: Mapping[str, tuple[float, float]], after: Mapping[str, tuple[float, float]]
) -> dict[str, float]:
    """Mean per request of what P did between two snapshots: ``arrival_to_step_s`` (its API
    server's arrival to its first scheduled step: e2e − inference) and ``prefill_s``."""

    def mean(name: str) -> float:
        s = after[name][0] - before[name][0]
        n = after[name][1] - before[name][1]
        return s / n if n > 0 else float("nan")

    e2e = mean("vllm:e2e_request_latency_seconds")
    inference = mean("vllm:request_inference_time_seconds")
    return {
        "arrival_to_step_s": e2e - inference,
        "prefill_s": mean("vllm:request_prefill_time_seconds"),
    }


def spread(values: Iterable[float]) -> dict[str, Any]:
    """min, median and max of the observed values (NaN: not observed), and how many there were;
    ``None`` for all three when there were none."""
    vs = sorted(v for v in values if v == v)
    if not vs:
        return {"min": None, "median": None, "max": None, "n": 0}
    return {"min": vs[0], "median": statistics.median(vs), "max": vs[-1], "n": len(vs)}


def quantile(values: Sequence[float], q: float) -> float | None:
    """The ``q`` quantile of ``values`` (inclusive method; None for none)."""
    vs = sorted(values)
    if not vs:
        return None
    if len(vs) == 1:
        return vs[0]
    return statistics.quantiles(vs, n=100, method="inclusive")[round(q * 100) - 1]


def match_reference(output: Sequence[int], refs: Mapping[str, Sequence[int]]) -> str | None:
    """Which reference ``output`` equals, if any (the same set of references for both systems).

    Computed by one engine alone, no transfer: ``n-1``, the engine's own continuation after a
    prefill of the prompt's first N − 1 tokens and its last token as a decode step (how
    kv-sidecar's decode computes: it loads N − 1 rows); ``n``, the engine's answer to the whole
    prompt (rows from a prefill of N tokens, as vLLM's MooncakeConnector's prefill computes
    them). Greedy outputs of a random model can differ between the two roundings; wrong KV
    matches neither."""
    for name, ref in refs.items():
        if list(output) == list(ref):
            return name
    return None


@dataclass(frozen=True)
class Iteration:
    """One engine step as vLLM logged it (``--enable-logging-iteration-details``)."""

    at: float  # time.time() of the log record
    context_requests: int
    context_tokens: int  # prompt tokens the step computed (vLLM: requests with no output yet)
    generation_requests: int
    generation_tokens: int
    elapsed_ms: float | None = None  # the step's model execution, vLLM's own clock


_ITERATION = re.compile(
    r"^(\d+\.\d+) .*?Iteration\(\d+\): (\d+) context requests, (\d+) context tokens, "
    r"(\d+) generation requests, (\d+) generation tokens"
    r"(?:, iteration elapsed time: (\d+(?:\.\d+)?) ms)?",
    re.M,
)


def parse_iterations(log_text: str) -> list[Iteration]:
    """vLLM's per-step lines in an engine log written with ``ITERATION_LOG_FORMAT``."""
    return [
        Iteration(
            float(m[1]), int(m[2]), int(m[3]), int(m[4]), int(m[5]), float(m[6]) if m[6] else None
        )
        for m in _ITERATION.finditer(log_text)
    ]


def step_periods(steps: Sequence[Iteration], t0: float, t1: float) -> list[float]:
    """Seconds between consecutive logged steps that both fall in ``[t0, t1]``: an engine's step
    time while it is busy (vLLM's own ``elapsed`` covers only sampling when the worker runs in
    the engine core, so the log stamps are the clock). An idle gap counts as a long step."""
    stamps = sorted(s.at for s in steps if t0 <= s.at <= t1)
    return [b - a for a, b in itertools.pairwise(stamps)]


def failed_loads(computed_tokens: int, prompt_tokens: int, prompts: int) -> int:
    """How many of a trial's ``prompts`` (``prompt_tokens`` each) decode computed itself instead
    of loading, from the prompt tokens decode's steps computed in the trial.

    A load leaves decode a token or so per prompt (the last one, for its logits); a failed one
    (vLLM's ``kv_load_failure_policy=recompute``) leaves it the prompt from the first bad
    block. Up to an eighth of a prompt each counts as loaded; what decode computed beyond that
    allowance, in prompts of (N − allowance) tokens, rounded up, failed. vLLM's
    ``prompt_tokens_by_source`` cannot tell: it books the tokens to be loaded when the request
    is first scheduled, before the load ran or failed."""
    if prompts <= 0 or prompt_tokens <= 0:
        return 0
    allow = prompt_tokens // 8
    excess = computed_tokens - prompts * allow
    if excess <= 0:
        return 0
    return min(prompts, math.ceil(excess / max(1, prompt_tokens - allow)))
