"""How every cost of one transfer grows with the prompt: 1k to 128k tokens, simulated engines.

``python -m app.bench.scaling [--lengths 1k,2k,...,128k] [--out FILE.json]`` starts one P/D
pair of real sidecars with simulated engines (``app.sim``, as ``kv-sidecar demo`` does: real
Mooncake transfers over loopback TCP, real shared-memory KV caches), sized for the longest
prompt, and moves one prompt of each length, shortest first, chunked as vLLM does on CPU
(2048-token steps), each layer of each step signalled after a simulated compute time. Per
length (the median of ``reps``):

- ``planning_cpu_ms``: CPU time of the pure planner (``PairPlanner.plan_layer`` and the join
  of its descriptors) for every layer of every step, in this process (``plans.PlanModel``;
  each call's median of 5: one call is a fraction of a millisecond, a GC pause is more);
- ``descriptors``: what P's sidecar submitted, and ``min_descriptors``, the maximal contiguous
  runs of the same bytes (``PlanModel.min_descriptors``);
- ``cpu_s_per_gb``: user + system CPU of both sidecar processes (every thread, ``/proc``)
  during the transfer, over the bytes moved;
- ``handoff_ms``: the last layer's signal at P to D's sidecar ending the request DONE (what
  the simulated pair exposes after the forward pass; ``Bench.run``'s ``exposed_s``), and
  ``handoff_ms_min``, the best rep's: a rep whose sidecars waited for a core (other work on
  the host) ends with a backlog of layers, which the median shows and the minimum does not;
- ``rss_anon_peak_mib``: the highest anonymous RSS of each sidecar, sampled every 10 ms during
  the transfer (the KV caches are shared memory, mapped, never copied: not anonymous);
  ``rss_peak_mib`` is ``VmHWM`` (every page ever resident, shared KV pages included);
  ``rss_anon_added_mib``, the anonymous peak above the shortest length's (what a longer prompt
  adds: its block tables and per-step records).

Each curve gets a least-squares slope in log-log space over the lengths from 4k (shorter ones
are dominated by fixed costs): 1 is linear, 0 flat. The JSON carries the host it ran on
(``result_file.write_result``).

``--baseline FILE.json`` compares this run's CPU per GB with an earlier run's, length by length,
and exits 3 when any is more than ``--limit`` (1.2: 20%) above it: the regression check of the
transfer path's CPU (run both on one quiet host; the JSONs name their hosts).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from app.bench.core.cores import descendants, process_cpu_s
from app.bench.core.harness import Bench, _log
from app.bench.core.host import NO_LINK, host_record
from app.bench.core.plans import PlanModel
from app.bench.core.raw import RawCeiling
from app.bench.core.result_file import write_result
from app.errors import BenchError
from app.sim.cluster import Cluster, ClusterSpec
from app.sim.commands import SimRequest

LENGTHS = tuple(1024 << i for i in range(8))  # 1k .. 128k
FIT_FROM = 4096  # shorter prompts: fixed costs (one step, handshakes, polls) dominate
MiB = 1 << 20


@dataclass(frozen=True)
class ScalingOptions:
    lengths: tuple[int, ...] = LENGTHS
    model: str = "llama-3.1-8b"  # 8 KV heads of 128: 4 KiB a token a layer in bf16
    layers: int = 2  # 128k x 2 layers x 4 KiB = 1 GiB of KV a side: fits beside other work
    chunk: int = 2048  # vLLM's chunked prefill on CPU
    compute_ms: float = 5.0  # simulated forward of one layer of one chunk
    reps: int = 3
    poll_ms: float = 1.0
    out: str | None = None
    fill: bool = False  # numpy fill at P and a byte check at D (slow at 128k; once is enough)
    extra_env: dict[str, str] = field(default_factory=dict)


class PeakSampler:
    """The highest anonymous RSS of each process while it runs (a thread polling ``/proc``)."""

    def __init__(self, pids: dict[str, int], every_s: float = 0.01) -> None:
        self.pids, self.every_s = pids, every_s
        self.peak = dict.fromkeys(pids, 0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def __enter__(self) -> PeakSampler:
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self._sample()

    def _sample(self) -> None:
        for role, pid in self.pids.items():
            self.peak[role] = max(self.peak[role], status_bytes(pid, "RssAnon"))


def status_bytes(pid: int, key: str) -> int:
    """One ``kB`` line of ``/proc/<pid>/status`` in bytes (0 when the process is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                name, _, value = line.partition(":")
                if name == key:
                    return int(value.split()[0]) * 1024
    except OSError:
        return 0
    return 0


def loglog_slope(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    """Least-squares slope of log y against log x (None: fewer than two positive points)."""
    pts = [(math.log(x), math.log(y)) for x, y in zip(xs, ys, strict=True) if x > 0 and y > 0]
    if len(pts) < 2:
        return None
    mx = sum(p[0] for p in pts) / len(pts)
    my = sum(p[1] for p in pts) / len(pts)
    var = sum((p[0] - mx) ** 2 for p in pts)
    return sum((p[0] - mx) * (p[1] - my) for p in pts) / var if var else None


def growth(slope: float | None) -> str:
    """The slope in words: flat, sublinear, linear, superlinear."""
    if slope is None:
        return "unknown"
    if abs(slope) < 0.15:
        return "flat"
    if slope < 0.85:
        return "sublinear"
    return "linear" if slope <= 1.15 else "superlinear"


def fits(rows: Sequence[dict[str, Any]], keys: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Each curve's log-log slope over the rows from ``FIT_FROM`` tokens (all rows where fewer
    than two reach it), and its growth in words."""
    used = [r for r in rows if r["tokens"] >= FIT_FROM]
    used = used if len(used) >= 2 else list(rows)
    out = {}
    for k in keys:
        slope = loglog_slope([r["tokens"] for r in used], [r[k] for r in used])
        out[k] = {
            "slope": None if slope is None else round(slope, 3),
            "growth": growth(slope),
            "from_tokens": used[0]["tokens"] if used else None,
        }
    return out


CURVES = (
    "planning_cpu_ms",
    "descriptors",
    "cpu_s_per_gb",
    "handoff_ms",
    "handoff_ms_min",
    "rss_anon_peak_mib_prefill",
    "rss_anon_peak_mib_decode",
    "rss_anon_added_mib_prefill",
    "rss_anon_added_mib_decode",
)


def _sidecar_pids(cluster: Cluster) -> dict[str, int]:
    out = {}
    for role, side in cluster.sides.items():
        if side.sidecar is None:
            raise BenchError(f"the {role} side has no sidecar process to measure")
        out[role] = side.sidecar.pid
    return out


def _transfer(
    b: Bench,
    pairs: Sequence[tuple[SimRequest, SimRequest]],
    opts: ScalingOptions,
    timeout_s: float,
) -> dict[str, Any]:
    """One chunked layer-wise transfer of ``pairs``, with the sidecars' CPU and peak RSS."""
    b.runs += 1
    pairs = [b._renamed(pr, dr, f"r{b.runs}-{pr.id}") for pr, dr in pairs]
    pids = _sidecar_pids(b.cluster)
    tree = descendants(pids.values())
    cpu0 = process_cpu_s(tree)
    with PeakSampler(pids) as rss:
        res = b.cluster.run(
            pairs,
            chunk=opts.chunk,
            compute_ms=opts.compute_ms,
            fill=opts.fill,
            verify=opts.fill,
            poll_ms=opts.poll_ms,
            timeout_s=timeout_s,
        )
    cpu_s = process_cpu_s(tree) - cpu0
    prefill, decode = res["prefill"]["ranks"], res["decode"]["ranks"]
    failed = {rid: f for r in [*prefill, *decode] for rid, f in r["failed"].items()}
    problems = {rid: p for r in decode for rid, p in r["problems"].items()}
    if failed or problems:
        first = next(iter({**failed, **problems}.items()))
        raise BenchError(f"transfer {first[0]} did not land intact: {first[1]}")
    nbytes = sum(r["bytes"] for r in prefill) - b.bytes_seen
    desc = sum(r["descriptors"] for r in prefill) - b.desc_seen
    b.bytes_seen += nbytes
    b.desc_seen += desc
    end = b._sidecar_done_at(res, pairs)
    if end is None:
        raise BenchError("decode's sidecar did not report when it ended the request")
    return {
        "bytes": nbytes,
        "descriptors": desc,
        "cpu_s": cpu_s,
        "handoff_s": max(0.0, end - res["prefill"]["last_layer_at"]),
        "forward_s": res["prefill"]["last_layer_at"] - res["prefill"]["first_layer_at"],
        "rss_anon_peak": dict(rss.peak),
        "verified": sum(len(r["verified"]) for r in decode) if opts.fill else 0,
    }


def measure_length(b: Bench, n: int, opts: ScalingOptions) -> dict[str, Any]:
    """Every figure of one prompt length (medians of ``opts.reps`` transfers)."""
    pairs = b.requests([n])
    try:
        submits = b.plans.submits(pairs, opts.chunk)
        min_desc = b.plans.min_descriptors(submits, across_layers=False)
        planning = sum(s for _, s in b.plans.planning_cpu(pairs, opts.chunk, repeat=5))
        steps = math.ceil(n / opts.chunk)
        forward_s = steps * len(b.plans.layers) * opts.compute_ms / 1e3
        runs = [_transfer(b, pairs, opts, 30 + 10 * forward_s) for _ in range(opts.reps)]
    finally:
        b.release(pairs)
    med = lambda k: statistics.median(r[k] for r in runs)  # noqa: E731
    pids = _sidecar_pids(b.cluster)
    row = {
        "tokens": n,
        "steps": steps,
        "bytes": runs[0]["bytes"],
        "planning_cpu_ms": round(planning * 1e3, 3),
        "descriptors": runs[0]["descriptors"],
        "min_descriptors": min_desc,
        "cpu_s": round(med("cpu_s"), 4),
        "cpu_s_per_gb": round(med("cpu_s") / (runs[0]["bytes"] / 1e9), 4),
        "handoff_ms": round(med("handoff_s") * 1e3, 3),
        "handoff_ms_min": round(min(r["handoff_s"] for r in runs) * 1e3, 3),
        # Each rep's: on two shared cores one rep in a few waits 100-200 ms for a core.
        "handoff_ms_reps": [round(r["handoff_s"] * 1e3, 3) for r in runs],
        "forward_ms": round(med("forward_s") * 1e3, 1),
        "verified": sum(r["verified"] for r in runs),
    }
    for role in pids:
        peak = max(r["rss_anon_peak"][role] for r in runs)
        row[f"rss_anon_peak_mib_{role}"] = round(peak / MiB, 2)
        row[f"rss_peak_mib_{role}"] = round(status_bytes(pids[role], "VmHWM") / MiB, 1)
    return row


def run(opts: ScalingOptions, progress: Callable[[str], None] = _log) -> dict[str, Any]:
    """Start the pair, warm it up, measure every length shortest first; the JSON-able result."""
    t0 = time.monotonic()
    load0 = list(os.getloadavg())
    lengths = sorted(set(opts.lengths))
    spec = ClusterSpec(
        model=opts.model,
        layers=opts.layers,
        prefill_tp=1,
        decode_tp=1,
        max_requests=1,
        max_prompt=max(lengths),
        sidecar_env={"KVSIDECAR_SHUTDOWN_GRACE_S": "1", **opts.extra_env},
    )
    rows = []
    with Cluster(spec) as cluster, RawCeiling(MiB) as raw:
        p, d = cluster.sides["prefill"].params, cluster.sides["decode"].params
        b = Bench(cluster, PlanModel(p, d), raw, opts.poll_ms)
        warm = b.requests([min(lengths)])
        try:  # the handshake and first-request paths, not counted
            _transfer(b, warm, opts, 60)
        finally:
            b.release(warm)
        progress(f"pair up and warm in {time.monotonic() - t0:.1f} s")
        for n in lengths:
            row = measure_length(b, n, opts)
            progress(
                f"{n:>6} tokens: {row['descriptors']} descriptors, planning "
                f"{row['planning_cpu_ms']:.1f} ms, {row['cpu_s_per_gb']:.3f} CPU s/GB, handoff "
                f"{row['handoff_ms']:.1f} ms, anon RSS P {row['rss_anon_peak_mib_prefill']:.1f}"
                f" / D {row['rss_anon_peak_mib_decode']:.1f} MiB"
            )
            rows.append(row)
    for role in ("prefill", "decode"):  # what a longer prompt adds to the sidecar's own memory
        base = rows[0][f"rss_anon_peak_mib_{role}"]
        for row in rows:
            row[f"rss_anon_added_mib_{role}"] = round(row[f"rss_anon_peak_mib_{role}"] - base, 2)
    return {
        "bench": "scaling",
        "options": asdict(opts) | {"lengths": lengths},
        "rows": rows,
        "fits": fits(rows, CURVES),
        # Other work on the host: what the handoff's spread depends on.
        "load_average": {"start": load0, "end": list(os.getloadavg())},
        "wall_s": round(time.monotonic() - t0, 1),
    }


def plot(result: dict[str, Any], path: Path) -> Path:
    """Each curve against the prompt length (log x), its fitted slope in the title."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    xs = [r["tokens"] for r in rows]
    fits_ = result["fits"]

    def slope(key: str) -> str:
        return f"{fits_[key]['slope']} ({fits_[key]['growth']})"

    base = {role: rows[0][f"rss_anon_peak_mib_{role}"] for role in ("prefill", "decode")}
    # (curves on the panel, log y, title)
    panels: list[tuple[tuple[str, ...], bool, str]] = [
        (("planning_cpu_ms",), True, f"planning CPU (ms)\nslope {slope('planning_cpu_ms')}"),
        (("descriptors",), True, f"descriptors\nslope {slope('descriptors')}"),
        (("cpu_s_per_gb",), False, f"sidecars' CPU s per GB\nslope {slope('cpu_s_per_gb')}"),
        (
            ("handoff_ms", "handoff_ms_min"),
            True,
            f"handoff (ms): median, best rep dashed\nslope {slope('handoff_ms')}; best "
            f"{slope('handoff_ms_min')}",
        ),
    ]
    for role in ("prefill", "decode"):
        key = f"rss_anon_added_mib_{role}"
        panels.append(
            (
                (key,),
                False,
                f"{role} sidecar: anon RSS peak above {base[role]:.1f} MiB (1k)\n"
                f"slope {slope(key)} (from {fits_[key]['from_tokens']} tokens)",
            )
        )
    fig, axes = plt.subplots(2, 3, figsize=(13, 7))
    for ax, (keys, log_y, title) in zip(axes.flat, panels, strict=True):
        for key, style in zip(keys, ("o-", "s--"), strict=False):
            ax.plot(xs, [r[key] for r in rows], style)
        ax.set_xscale("log", base=2)
        if log_y:
            ax.set_yscale("log")
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("prompt tokens")
        ax.grid(True, which="both", alpha=0.3)
    o = result["options"]
    fig.suptitle(
        f"scaling: {o['model']} x{o['layers']} layers, {o['chunk']}-token chunks, "
        f"{o['compute_ms']} ms a layer a chunk, simulated engines, real sidecars and Mooncake "
        f"(loopback TCP)",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def write(result: dict[str, Any], path: Path) -> dict[str, Any]:
    """``result`` as JSON at ``path`` with the host it ran on (no vLLM engine, no link: the
    sidecars talk over loopback); what was written."""
    return write_result(path, result, host_record(engines={}, link=NO_LINK))


REGRESSION_LIMIT = 1.2  # CPU per GB more than 20% above the baseline's: a regression


def against_baseline(
    baseline: Sequence[dict[str, Any]], rows: Sequence[dict[str, Any]], limit: float
) -> list[dict[str, Any]]:
    """Per length both runs measured: CPU per GB now, then, their ratio and whether it is over
    ``limit``."""
    then = {int(r["tokens"]): float(r["cpu_s_per_gb"]) for r in baseline}
    out = []
    for r in rows:
        n = int(r["tokens"])
        if n in then and then[n] > 0:
            ratio = float(r["cpu_s_per_gb"]) / then[n]
            out.append(
                {
                    "tokens": n,
                    "cpu_s_per_gb": r["cpu_s_per_gb"],
                    "baseline_cpu_s_per_gb": then[n],
                    "ratio": round(ratio, 3),
                    "regressed": ratio > limit,
                }
            )
    return out


def baseline_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of an earlier ``bench scaling`` JSON; a ``BenchError`` saying what is wrong."""
    try:
        rows = json.loads(path.read_text())["rows"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise BenchError(f"--baseline {path}: expected a bench scaling JSON ({e!r})") from None
    if not isinstance(rows, list) or not all("cpu_s_per_gb" in r for r in rows):
        raise BenchError(f"--baseline {path}: its rows carry no cpu_s_per_gb")
    return rows


def parse_tokens(text: str) -> int:
    """``4096``, ``4k`` (4096) or ``128K``: a prompt length in tokens."""
    t = text.strip().lower()
    try:
        n = int(t[:-1]) * 1024 if t.endswith("k") else int(t)
    except ValueError:
        raise BenchError(f"--lengths {text!r}: expected tokens such as 4096 or 4k") from None
    if n < 1:
        raise BenchError(f"--lengths {text!r}: expected at least 1 token")
    return n


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m app.bench.scaling", description=__doc__)
    ap.add_argument("--lengths", default=",".join(f"{n // 1024}k" for n in LENGTHS))
    ap.add_argument("--model", default=ScalingOptions.model)
    ap.add_argument("--layers", type=int, default=ScalingOptions.layers)
    ap.add_argument("--chunk", type=int, default=ScalingOptions.chunk)
    ap.add_argument("--compute-ms", type=float, default=ScalingOptions.compute_ms)
    ap.add_argument("--reps", type=int, default=ScalingOptions.reps)
    ap.add_argument("--fill", action="store_true", help="fill at P and check every byte at D")
    ap.add_argument("--out", default="bench-scaling.json")
    ap.add_argument("--plot", action="store_true", help="a PNG beside the JSON (matplotlib)")
    ap.add_argument("--baseline", type=Path, help="an earlier run's JSON: exit 3 on a regression")
    ap.add_argument("--limit", type=float, default=REGRESSION_LIMIT, help="CPU/GB ratio allowed")
    a = ap.parse_args(argv)
    opts = ScalingOptions(
        lengths=tuple(parse_tokens(x) for x in a.lengths.split(",") if x),
        model=a.model,
        layers=a.layers,
        chunk=a.chunk,
        compute_ms=a.compute_ms,
        reps=a.reps,
        out=a.out,
        fill=a.fill,
    )
    try:
        before = baseline_rows(a.baseline) if a.baseline is not None else None
        result = run(opts)
    except BenchError as e:
        print(f"bench scaling did not finish: {e}", file=sys.stderr)
        sys.exit(2)
    if before is not None:
        result["baseline"] = {
            "file": str(a.baseline),
            "limit": a.limit,
            "rows": against_baseline(before, result["rows"], a.limit),
        }
    out = Path(a.out)
    written = write(result, out)
    print(f"figures: {out}", file=sys.stderr)
    if a.plot:
        print(f"plot: {plot(written, out.with_suffix('.png'))}", file=sys.stderr)
    if before is not None:
        compared = result["baseline"]["rows"]
        for c in compared:
            flag = "REGRESSED" if c["regressed"] else "ok"
            print(
                f"{c['tokens']:>6} tokens: {c['cpu_s_per_gb']:.3f} CPU s/GB against "
                f"{c['baseline_cpu_s_per_gb']:.3f}: x{c['ratio']:.2f} {flag}",
                file=sys.stderr,
            )
        if not compared:
            print("bench scaling: no length in common with the baseline", file=sys.stderr)
            sys.exit(2)
        if any(c["regressed"] for c in compared):
            sys.exit(3)


if __name__ == "__main__":
    main()
