"""The unloaded run that calibrates a run under load (``bench load``, ``bench soak``, ``bench
faults``): each calibration length alone on each system; the SLO and the service time from it.
And what such a run is set up with: the regime's binding, the engines' dtype, the model."""

from __future__ import annotations

import math
import os
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.bench.core.cores import Binding, binding
from app.bench.core.engine_dtype import DtypeChoice, engine_dtype
from app.bench.core.slo import Slo, SloFactors, derive_slo
from app.bench.core.step import unloaded
from app.bench.core.systems import System
from app.bench.core.workload import Lengths, Request
from app.harness.tiny_models import write_tiny_model

CALIBRATION_RUNG = 999  # prompts of the unloaded run: distinct from every rate step's


def calibration_lengths(lengths: Lengths) -> tuple[int, ...]:
    """Short, median and long (~P90 of the lognormal) prompts: the line prefill(n) is fit on."""
    p90 = round(lengths.median * math.exp(1.2816 * lengths.sigma))  # z(0.9) = 1.2816
    return tuple(sorted({lengths.lo, lengths.median, min(lengths.hi, p90)}))


def calibrate(
    systems: list[System], lengths: Lengths, reps: int, factors: SloFactors | None = None
) -> tuple[list[dict[str, Any]], Slo, float]:
    """The unloaded run: each calibration length alone, systems alternating; the SLO (one, for
    both, with ``factors``' multiples) and the service time (median unloaded e2e over both)."""
    out_tokens = (lengths.out_lo + lengths.out_hi) // 2
    rows = []
    k = 0
    for rep in range(reps):
        for i, n in enumerate(calibration_lengths(lengths)):
            order = systems if (rep + i) % 2 == 0 else systems[::-1]
            for s in order:
                r = unloaded(s, Request(k, 0.0, n, out_tokens), CALIBRATION_RUNG)
                k += 1
                print(f"unloaded {s.name:12} {n:5} tokens: {_unloaded_text(r)}", flush=True)
                rows.append(r)
    ok = [r for r in rows if r["error"] is None and r["tokens"] == r["max_tokens"]]
    slo = derive_slo(ok, factors)
    service = statistics.median(r["e2e_s"] for r in ok)
    return rows, slo, service


def _unloaded_text(r: dict[str, Any]) -> str:
    if r["error"] is not None:
        return f"FAILED {r['error']}"
    return (
        f"TTFT {1e3 * r['ttft_s']:.0f} ms, P prefill {1e3 * r['p_prefill_s']:.0f} ms, "
        f"TPOT {1e3 * (r['tpot_s'] or 0):.1f} ms, e2e {1e3 * r['e2e_s']:.0f} ms"
    )


@dataclass(frozen=True)
class Setup:
    """What a run under load is set up with, printed as it is chosen."""

    binding: Binding
    dtype: DtypeChoice
    lengths: Lengths
    model: Path


def set_up(
    regime: str, dtype: str | None, lengths: Lengths, model: dict[str, Any], work: Path
) -> Setup:
    """The regime's binding (in this process's environment: the engines inherit it), the
    engines' dtype, the workload fitted to the model's length, the model written."""
    b = binding(regime, os.sched_getaffinity(0))
    os.environ.update(b.env())
    print(b.describe(), flush=True)
    # The same for every engine of both systems; asked for: the CPU's flags not consulted.
    choice = engine_dtype() if dtype is None else DtypeChoice(dtype, "given by --dtype")
    print(choice.describe(), flush=True)
    fitted = lengths.fit(int(model.get("max_position_embeddings", 4096)))
    print(f"workload: {fitted}", flush=True)
    path = write_tiny_model(
        work / f"model-{model['hidden_size']}x{model['num_hidden_layers']}",
        "llama",
        overrides=model,
    )
    return Setup(b, choice, fitted, path)
