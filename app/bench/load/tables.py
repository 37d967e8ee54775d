"""``bench load``'s result as docs/benchmarks.md shows it: a row per rate, kv-sidecar's figure
then MooncakeConnector's in each cell, from each system's step at that rate (the runs in the
docs have one rep; the A/A pass is in the prose)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from app.bench.core.slo import ATTAINMENT
from app.bench.core.stats import MOONCAKE, SIDECAR
from app.bench.core.tables import Table, num
from app.bench.core.target_path import STAGES
from app.bench.load.compare import ttft_interval
from app.errors import BenchError

Step = Mapping[str, Any]  # one system's step at one rate
Column = tuple[str, Callable[[Step, Step], str]]  # header, (kv-sidecar's step, mooncake's) -> cell


def _pair(key: str, fmt: Callable[[float], str], sep: str = " / ") -> Callable[[Step, Step], str]:
    return lambda a, b: f"{fmt(a[key])}{sep}{fmt(b[key])}"


def _s(ms: float) -> str:
    return num(ms / 1e3, 2)


def _share(v: float) -> str:
    return f"{num(100 * v)}%"


def _slo_met_knee(a: Step, b: Step) -> str:
    # Bold where both reach the knee's share: the rates the knee is read from.
    text = f"{_share(a['attainment'])} / {_share(b['attainment'])}"
    return f"**{text}**" if min(a["attainment"], b["attainment"]) >= ATTAINMENT else text


def _slo_parts(a: Step, b: Step) -> str:
    return (
        f"{_share(a['attainment'])} / {_share(b['attainment'])} "
        f"({_share(a['ttft_ok_share'])} / {_share(b['ttft_ok_share'])}, "
        f"{_share(a['tpot_ok_share'])} / {_share(b['tpot_ok_share'])})"
    )


RATE: Column = ("rate req/s", lambda a, _: f"{a['rate']:.3g}")
TTFT_P90: Column = ("TTFT P90 s: kv-sidecar / mooncake", _pair("ttft_p90_ms", _s))


def _ratio(a: Step, b: Step) -> str:
    """TTFT P90 kv-sidecar / mooncake and its 90% interval, paired over the step's requests."""
    iv = ttft_interval([a], [b], 90)
    point = num(a["ttft_p90_ms"] / b["ttft_p90_ms"], 2)
    if iv is None or iv.low is None or iv.high is None:
        return point
    return f"{point} [{num(iv.low, 2)}–{num(iv.high, 2)}]"


RATIO: Column = ("ratio [90%]", _ratio)
HANDOFF: Column = ("handoff ms", _pair("handoff_ms", num))
GOODPUT: Column = ("goodput req/s", _pair("goodput_rps", lambda v: num(v, 3)))
SLO_MET: Column = ("SLO met", _pair("attainment", _share))
CPU_PER_REQUEST: Column = ("transfer-path CPU ms a request", _pair("cpu_ms_per_request", num))

SHARED = (  # the shared regime's full run
    RATE,
    TTFT_P90,
    RATIO,
    ("handoff ms: kv-sidecar / mooncake", HANDOFF[1]),
    GOODPUT,
    SLO_MET,
    (
        "transfer-path CPU s: kv-sidecar / mooncake",
        _pair("transfer_cpu_ms", lambda ms: f"{ms / 1e3:.2g}"),
    ),
)
SPLIT = (  # the split regime's full run
    RATE,
    TTFT_P90,
    RATIO,
    HANDOFF,
    ("TPOT P50 ms", _pair("tpot_p50_ms", lambda v: num(v, 1))),
    GOODPUT,
    ("SLO met (TTFT ok, TPOT ok)", _slo_parts),
    CPU_PER_REQUEST,
)
FULL_LENGTH = (  # every drawn token, the split regime: where the knee is
    RATE,
    ("n", lambda a, _: str(a["n_requests"])),
    TTFT_P90,
    RATIO,
    HANDOFF,
    GOODPUT,
    ("SLO met", _slo_met_knee),
    CPU_PER_REQUEST,
)


def _num_or_dash(v: float | None) -> str:
    return "-" if v is None else num(v)


def _after_p_max(step: Step) -> float | None:
    """The step's largest P-answer → first-token time (ms); runs before the max was written
    kept every request's times."""
    if "after_p_max_ms" in step:
        return step["after_p_max_ms"]
    vs = [
        1e3 * (q["first"] - q["p_answered"])
        for q in step["requests"]
        if q.get("first") is not None and q.get("p_answered") is not None
    ]
    return max(vs, default=None)


SHAPED = (  # the dedicated regime on a shaped link: the handoff request by request
    RATE,
    TTFT_P90,
    RATIO,
    (
        # The max, not a "P99" over a step's few requests (core.slo.tail).
        "after P ms, P50 / max: kv-sidecar; mooncake",
        lambda a, b: "; ".join(
            f"{num(r['after_p_p50_ms'])} / {_num_or_dash(_after_p_max(r))}" for r in (a, b)
        ),
    ),
    ("layer write ms", lambda a, _: num(a["layer_write_ms"])),  # kv-sidecar's alone
    ("TPOT P90 ms: kv-sidecar / mooncake", _pair("tpot_p90_ms", lambda v: num(v, 1))),
    GOODPUT,
    SLO_MET,
)
TPOT = (  # every drawn token, the dedicated regime
    RATE,
    TTFT_P90,
    RATIO,
    HANDOFF,
    (
        "TPOT P50 / P90 ms: kv-sidecar; mooncake",
        lambda a, b: "; ".join(
            f"{num(r['tpot_p50_ms'], 1)} / {num(r['tpot_p90_ms'], 1)}" for r in (a, b)
        ),
    ),
    GOODPUT,
    SLO_MET,
)


def _rates(result: Mapping[str, Any], columns: Sequence[Column]) -> Table:
    by_rate: dict[float, dict[str, Step]] = {}
    for s in result["steps"]:
        if s["system"] in by_rate.setdefault(s["rate"], {}):
            raise BenchError(
                f"a table of one step per system and rate, got two of {s['system']} at "
                f"{s['rate']} req/s (reps {result['options'].get('reps')})"
            )
        by_rate[s["rate"]][s["system"]] = s
    return Table(
        tuple(h for h, _ in columns),
        tuple(
            tuple(cell(by[SIDECAR], by[MOONCAKE]) for _, cell in columns)
            for _, by in sorted(by_rate.items())
        ),
    )


def shared(result: Mapping[str, Any]) -> Table:
    return _rates(result, SHARED)


def split(result: Mapping[str, Any]) -> Table:
    return _rates(result, SPLIT)


def full_length(result: Mapping[str, Any]) -> Table:
    return _rates(result, FULL_LENGTH)


def shaped(result: Mapping[str, Any]) -> Table:
    return _rates(result, SHAPED)


def tpot(result: Mapping[str, Any]) -> Table:
    return _rates(result, TPOT)


AA_LABEL = {f"{SIDECAR}-aa": f"{SIDECAR} (A/A)"}
SYSTEM_ORDER = (SIDECAR, f"{SIDECAR}-aa", MOONCAKE)


def _rate_cell(v: float) -> str:
    return "0" if v == 0 else num(v, 2)


def systems(result: Mapping[str, Any]) -> Table:
    """A row per rate and system (kv-sidecar, its A/A pass, mooncake): the step's figures."""
    header = (
        "rate/s",
        "system",
        "n",
        "TTFT p50 / p90 ms",
        "handoff ms",
        "P prefill ms",
        "P queue ms",
        "TPOT p50 ms",
        "thr/s",
        "good/s",
        "SLO met",
        "D records not DONE",
        "decode recomputed (est.)",
    )
    steps = sorted(result["steps"], key=lambda s: (s["rate"], SYSTEM_ORDER.index(s["system"])))
    rows = tuple(
        (
            f"{s['rate']:.3g}",
            AA_LABEL.get(s["system"], s["system"]),
            str(s["n_requests"]),
            f"{num(s['ttft_p50_ms'])} / {num(s['ttft_p90_ms'])}",
            num(s["handoff_ms"]),
            num(s["p_prefill_ms"]),
            num(s["p_queue_ms"]),
            num(s["tpot_p50_ms"], 1),
            _rate_cell(s["throughput_rps"]),
            _rate_cell(s["goodput_rps"]),
            _share(s["attainment"]),
            "-" if s["transfers_failed"] is None else str(s["transfers_failed"]),  # kv-sidecar's
            str(s["failed_loads_est"]),
        )
        for s in steps
    )
    return Table(header, rows)


def target(result: Mapping[str, Any]) -> Table:
    """kv-sidecar's decode: its time to target per rate, P50 / P90 ms from the proxy's start."""
    header = ("rate/s", "announced", "target at the proxy", "prefill's first layer submitted")
    rows = []
    for s in sorted(result["steps"], key=lambda s: s["rate"]):
        if s["system"] != SIDECAR:
            continue
        path = s["target_path"]
        rows.append(
            (
                f"{s['rate']:.3g}",
                *(f"{num(path[k]['p50'])} / {num(path[k]['p90'])}" for k in STAGES),
            )
        )
    return Table(header, tuple(rows))
