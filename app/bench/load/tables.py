"""``bench load``'s result as docs/benchmarks.md shows it: a row per rate, kv-sidecar's figure
then MooncakeConnector's in each cell (medians over the reps; the A/A pass is in the prose)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from app.bench.core.stats import MOONCAKE, SIDECAR
from app.bench.core.tables import Table, num

Row = Mapping[str, Any]  # one system's summary row at one rate
Column = tuple[str, Callable[[Row, Row], str]]  # header, (kv-sidecar's row, mooncake's) -> cell


def _m(r: Row, key: str) -> float:
    return float(r[key]["median"])


def _pair(key: str, fmt: Callable[[float], str], sep: str = " / ") -> Callable[[Row, Row], str]:
    return lambda a, b: f"{fmt(_m(a, key))}{sep}{fmt(_m(b, key))}"


def _s(ms: float) -> str:
    return num(ms / 1e3, 2)


def _share(v: float) -> str:
    return f"{num(100 * v)}%"


RATE: Column = ("rate req/s", lambda a, _: f"{a['rate']:.3g}")
TTFT_P90: Column = ("TTFT P90 s: kv-sidecar / mooncake", _pair("ttft_p90_ms", _s))
RATIO: Column = (
    "ratio",
    lambda a, b: num(_m(a, "ttft_p90_ms") / _m(b, "ttft_p90_ms"), 2),
)
GOODPUT: Column = ("goodput req/s", _pair("goodput_rps", lambda v: num(v, 3)))
SLO_MET: Column = ("SLO met", _pair("attainment", _share))


def _handoff(header: str) -> Column:
    return (header, _pair("handoff_ms", num))


SHARED = (  # the shared regime's full run
    RATE,
    TTFT_P90,
    RATIO,
    _handoff("handoff ms: kv-sidecar / mooncake"),
    GOODPUT,
    SLO_MET,
    (
        "transfer-path CPU s: kv-sidecar / mooncake",
        _pair("transfer_cpu_ms", lambda ms: f"{ms / 1e3:.2g}"),
    ),
)
TPOT = (  # the dedicated regime, every drawn token
    RATE,
    TTFT_P90,
    RATIO,
    _handoff("handoff ms"),
    (
        "TPOT P50 / P90 ms: kv-sidecar; mooncake",
        lambda a, b: "; ".join(
            f"{num(_m(r, 'tpot_p50_ms'), 1)} / {num(_m(r, 'tpot_p90_ms'), 1)}" for r in (a, b)
        ),
    ),
    GOODPUT,
    SLO_MET,
)


def _rates(result: Mapping[str, Any], columns: Sequence[Column]) -> Table:
    rows: dict[float, dict[str, Row]] = {}
    for r in result["summary"]["rows"]:
        rows.setdefault(r["rate"], {})[r["system"]] = r
    return Table(
        tuple(h for h, _ in columns),
        tuple(
            tuple(cell(by[SIDECAR], by[MOONCAKE]) for _, cell in columns)
            for _, by in sorted(rows.items())
        ),
    )


def shared(result: Mapping[str, Any]) -> Table:
    return _rates(result, SHARED)


def tpot(result: Mapping[str, Any]) -> Table:
    return _rates(result, TPOT)
