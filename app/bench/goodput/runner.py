"""The benchmark: real sidecars and engines as separate processes, the real Mooncake engine.

Every number that is compared is measured side by side in the same run (the machine is small and
shared, so absolute numbers are noisy and the ratios are what the goals are about):

- raw ceiling: the planned descriptor sizes written as plain Mooncake writes from this
  process into a peer process (``RawCeiling``), waiting both ways the sidecar can (polled
  single-descriptor transfers and busy-spinning batch calls), before and after each pipeline
  run; the faster way's mean of the two is the ceiling that run is compared with;
- goodput: the layer-wise pipeline from the first layer's signal to D's sidecar ending the
  request (``fill=False``: the simulated engine's numpy fill is not part of the transfer);
- overlap: with a simulated compute time per layer (``compute_ratio`` x the mean layer's raw
  write time), the time from the last layer's signal to D's sidecar ending the request,
  layer-wise and in bulk (every layer in one submission after the last one);
- descriptors the sidecar submitted against the minimum (maximal contiguous runs, never across
  two registrations) from the same planner in this process;
- planning CPU time per layer per step against the raw write time of those bytes;
- scale: requests in flight, layers and groups; the sidecars' anonymous RSS across repeats.

Every cluster also moves three prompts byte-exact (fill at P, checked at D), in both send modes.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from app.bench.core.harness import Bench, _log, _median
from app.bench.core.plans import PlanModel
from app.bench.core.raw import RawCeiling
from app.kvcache.presets import load_preset
from app.sim.cluster import Cluster, ClusterSpec
from app.sim.reference import blocks_needed

MiB = 1 << 20
VERIFY_LENS = (1000, 333, 17)  # prompts checked byte-exact once per cluster, both send modes


@dataclass
class ScalePoint:
    """A model scaled to some layers: one cluster, measured like the main one, briefly."""

    model: str
    layers: int
    requests: int = 4
    prompt_tokens: int = 2048


@dataclass
class BenchOptions:
    """What to run; the defaults are the full run, ``quick_preset`` the routine one."""

    model: str = "llama-3.1-8b"
    layers: int = 8
    prefill_tp: int = 1
    decode_tp: int = 1
    requests: int = 4  # goodput: requests in one step
    prompt_tokens: int = 4096
    lengths: tuple[int, ...] = (256, 512, 1024, 2048, 4096, 8192)  # overlap sweep
    reps: int = 9  # interleaved raw / pipeline goodput pairs
    overlap_reps: int = 3  # per prompt length: raw, layer-wise and bulk, interleaved
    # Simulated compute per layer / raw write time of that layer. Prefill compute outlasts the
    # transfer on real links (an H100 layer of Llama-8B at 4k tokens ~3-5 ms, its 16 MiB of KV
    # 0.3-1.3 ms at 100-400 Gb/s); 2 keeps that regime with room for this machine's noise.
    compute_ratio: float = 2.0
    scale_requests: tuple[int, ...] = (1, 4, 16, 64, 256)
    scale_tokens: int = 16384  # tokens per scale run, split evenly over its requests
    scale_repeats: int = 3  # passes over the request sweep; RSS is compared first to last
    layouts: tuple[str, ...] = ("per_layer", "cross_layer")
    points: tuple[ScalePoint, ...] = (
        ScalePoint("llama-3.1-8b", 16),
        ScalePoint("llama-3.1-8b", 32),
        # 64 cache layers (latent + indexer, one group); long prompts so a layer is not tiny.
        ScalePoint("deepseek-v3.2-exp", 32, requests=2, prompt_tokens=8192),
        ScalePoint("gpt-oss-20b", 8, prompt_tokens=4096),  # 2 groups
        ScalePoint("qwen3-next-80b-a3b", 8, prompt_tokens=4096),  # 4 groups
    )
    raw_bytes: int = 512 * MiB
    # The engines poll their sidecars for completions as a vLLM worker does once per step (a
    # decode step is ~10-30 ms); each poll costs ~0.2 ms of CPU on two cores the transfer uses.
    # Goodput and scale are timed at D's sidecar, so the poll does not limit their resolution.
    poll_ms: float = 10.0
    overlap_poll_ms: float = 1.0  # the resolution of every exposed time
    start_timeout_s: float = 300.0
    log_dir: str | None = None
    quick: bool = False

    @classmethod
    def quick_preset(cls) -> BenchOptions:
        """For routine use: one cluster, fewer lengths and requests, fewer repetitions."""
        return cls(
            requests=2,
            prompt_tokens=4096,
            lengths=(512, 1024, 4096),
            reps=4,
            overlap_reps=1,
            scale_requests=(1, 16, 256),
            scale_tokens=4096,
            scale_repeats=2,
            layouts=("per_layer",),
            points=(),
            raw_bytes=256 * MiB,
            quick=True,
        )


def _pool_shape(spec: ClusterSpec, workloads: Sequence[Sequence[int]]) -> tuple[int, int]:
    """(max_requests, max_prompt) whose pool holds the largest of ``workloads`` on both sides."""
    model = load_preset(spec.model, layers=spec.layers)
    bs = spec.block_size or model.default_block_size()
    tps = (spec.prefill_tp, spec.decode_tp)
    need = max(blocks_needed(model, tp, bs, w) for w in workloads for tp in tps)
    reqs = max(len(w) for w in workloads)
    prompt = 16
    while min(blocks_needed(model, tp, bs, [prompt] * reqs) for tp in tps) < need:
        prompt *= 2
    return reqs, prompt


def _overlap(
    b: Bench, length: int, reps: int, compute_ratio: float, poll_ms: float
) -> dict[str, Any]:
    """Exposed time after the last layer, layer-wise and bulk, for one prompt length.

    A layer's transfer time comes from the raw writes of the same submits (bytes over the
    warm rate: the first write after idle pays TCP's slow-start-after-idle ramp here). The
    simulated compute per layer is ``compute_ratio`` x the mean layer; the goal is against the
    last layer, which layer-wise sending cannot hide (a hybrid's last layer may be its largest).
    """
    pairs = b.requests([length])
    rates: list[float] = []
    lay_exp, bulk_exp, lay_desc, bulk_desc, engine_exp = [], [], [], [], []
    timed_at_sidecar = True
    min_lay = min_bulk = 0
    try:
        submits = b.plans.submits(pairs)
        sizes = [s.nbytes for s in submits]
        for _ in range(reps):
            times = b.raw_write(submits)
            warm = slice(1, None) if len(times) > 1 else slice(None)
            rates.append(sum(sizes[warm]) / sum(times[warm]))
            compute_ms = compute_ratio * float(np.mean(sizes)) / _median(rates) * 1e3
            lw, _, min_lay = b.run(pairs, compute_ms=compute_ms, poll_ms=poll_ms)
            bk, _, min_bulk = b.run(pairs, bulk=True, compute_ms=compute_ms, poll_ms=poll_ms)
            lay_exp.append(lw.exposed_s)
            bulk_exp.append(bk.exposed_s)
            engine_exp.append(lw.engine_exposed_s)
            timed_at_sidecar = timed_at_sidecar and lw.sidecar_timed and bk.sidecar_timed
            lay_desc.append(lw.descriptors)
            bulk_desc.append(bk.descriptors)
    finally:
        b.release(pairs)
    rate = _median(rates)
    layer_ms = float(np.mean(sizes)) / rate * 1e3
    last_ms = sizes[-1] / rate * 1e3
    exposed = _median(lay_exp) * 1e3
    bulk = _median(bulk_exp) * 1e3
    limit = 1.5 * last_ms + 2.0
    return {
        "prompt_tokens": length,
        "layer_bytes": int(np.mean(sizes)),
        "last_layer_bytes": sizes[-1],
        "layer_ms": round(layer_ms, 3),
        "last_layer_ms": round(last_ms, 3),
        "compute_ms": round(compute_ratio * layer_ms, 3),
        "exposed_ms": round(exposed, 3),
        "bulk_exposed_ms": round(bulk, 3),
        "overlap_ratio": round(exposed / bulk, 4) if bulk else None,
        "exposed_limit_ms": round(limit, 3),
        "exposed_ok": exposed <= limit,
        "engine_exposed_ms": round(_median(engine_exp) * 1e3, 3),
        "timed_at": "decode sidecar" if timed_at_sidecar else "decode engine",
        "descriptors": {"layerwise": max(lay_desc), "bulk": max(bulk_desc)},
        "min_descriptors": {"layerwise": min_lay, "bulk": min_bulk},
    }


def _goodput(b: Bench, lens: Sequence[int], reps: int) -> dict[str, Any]:
    """The layer-wise pipeline on the same bytes as raw writes, ``reps`` times.

    Raw, pipeline, raw, pipeline, ..., raw, each raw position written both ways of waiting. The
    ceiling is the way with the higher median over the section (a choice on all samples, so one
    lucky write does not pick it), and each pipeline run is compared with the mean of that way's
    writes either side of it: a drift in the machine's speed cancels and neither side gets the
    better of two noisy samples.
    """
    pairs = b.requests(lens)
    lay_gbps: list[float] = []
    desc = min_desc = nbytes = 0
    by_wait: dict[str, list[float]] = {}
    try:
        submits = b.plans.submits(pairs)
        total = sum(s.nbytes for s in submits)
        cpu = b.plans.planning_cpu(pairs)
        b.raw_write(submits, by_wait)
        for _ in range(reps):
            lw, _, min_desc = b.run(pairs)
            lay_gbps.append(lw.gbps)
            b.raw_write(submits, by_wait)
            desc, nbytes = lw.descriptors, lw.nbytes
    finally:
        b.release(pairs)
    best = max(by_wait, key=lambda w: _median(by_wait[w]))
    raw_gbps = by_wait[best]
    ceiling = [(a + c) / 2 for a, c in itertools.pairwise(raw_gbps)]
    ratios = [g / c for g, c in zip(lay_gbps, ceiling, strict=True)]
    raw_s = total / (_median(raw_gbps) * 1e9)
    return {
        "requests": len(lens),
        "prompt_tokens": max(lens),
        "bytes": nbytes,
        "raw_gbps": round(_median(raw_gbps), 4),
        "raw_wait": best,
        "raw_gbps_by_wait": {w: round(_median(g), 4) for w, g in by_wait.items()},
        "layerwise_gbps": round(_median(lay_gbps), 4),
        "goodput_ratio": round(_median(ratios), 4),
        "goodput_ratios": [round(r, 4) for r in ratios],
        "descriptors": desc,
        "min_descriptors": min_desc,
        "planning_ms_per_layer": round(_median([c for _, c in cpu]) * 1e3, 3),
        "planning_fraction": round(sum(c for _, c in cpu) / raw_s, 5),
    }


def _requests_sweep(b: Bench, opts: BenchOptions) -> dict[str, Any]:
    """1 -> 256 requests in flight at once, repeated; RSS after warm-up and after the last."""
    rows: dict[int, dict[str, Any]] = {}
    rss_first: dict[str, dict[str, int]] = {}
    rss_each = []
    for rep in range(opts.scale_repeats):
        for n in opts.scale_requests:
            tokens = max(16, opts.scale_tokens // n)
            lens = [tokens] * n
            pairs = b.requests(lens)
            try:
                submits = b.plans.submits(pairs)
                cpu = b.plans.planning_cpu(pairs) if rep == 0 else []
                t = b.raw_write(submits)
                res, _, min_desc = b.run(pairs)
                t_after = b.raw_write(submits)  # the better raw write either side, as above
            finally:
                b.release(pairs)
            raw = sum(s.nbytes for s in submits) / min(sum(t), sum(t_after)) / 1e9
            row = rows.setdefault(
                n,
                {
                    "requests": n,
                    "prompt_tokens": tokens,
                    "failures": 0,
                    "gbps": [],
                    "ratio": [],
                    "admission_ms": [],
                },
            )
            row["admission_ms"].append(res.admitted_s * 1e3)
            row["failures"] += len(res.failures)
            row["gbps"].append(res.gbps)
            row["ratio"].append(res.gbps / raw)
            row["descriptors"], row["min_descriptors"] = res.descriptors, min_desc
            if cpu:
                row["planning_fraction"] = round(sum(c for _, c in cpu) / sum(t), 5)
                row["planning_ms_per_layer"] = round(_median([c for _, c in cpu]) * 1e3, 3)
        rss = b.rss()
        rss_each.append(rss)
        if rep == 0:
            rss_first = rss
        _log(f"requests sweep pass {rep + 1}/{opts.scale_repeats}: rss {_fmt_rss(rss)}")
    out_rows = []
    for row in rows.values():
        row["gbps"] = round(_median(row["gbps"]), 4)
        row["goodput_ratio"] = round(_median(row["ratio"]), 4)
        row["admission_ms"] = round(_median(row["admission_ms"]), 3)
        del row["ratio"]
        out_rows.append(row)
    last = rss_each[-1]
    growth = {role: last[role]["RssAnon"] - rss_first[role]["RssAnon"] for role in rss_first}
    max_ok = max((r["requests"] for r in out_rows if r["failures"] == 0), default=0)
    return {
        "rows": out_rows,
        "max_in_flight": max_ok,
        "rss": rss_each,
        "rss_growth_bytes": growth,
    }


def _fmt_rss(rss: dict[str, dict[str, int]]) -> str:
    return ", ".join(f"{k} anon {v['RssAnon'] / MiB:.1f} MiB" for k, v in rss.items())


def _cluster(
    opts: BenchOptions, model: str, layers: int, layout: str, workloads: list[list[int]]
) -> Cluster:
    log_dir = None
    if opts.log_dir:
        path = Path(opts.log_dir) / f"{model}-x{layers}-{layout}"
        path.mkdir(parents=True, exist_ok=True)
        log_dir = str(path)
    spec = ClusterSpec(
        model=model,
        layers=layers,
        prefill_tp=opts.prefill_tp,
        decode_tp=opts.decode_tp,
        layout=layout,
        log_dir=log_dir,
        sidecar_env={"KVSIDECAR_SHUTDOWN_GRACE_S": "1"},
    )
    spec.max_requests, spec.max_prompt = _pool_shape(spec, [*workloads, list(VERIFY_LENS)])
    return Cluster(spec)


def _open(
    opts: BenchOptions,
    raw: RawCeiling,
    model: str,
    layers: int,
    layout: str,
    workloads: list[list[int]],
) -> tuple[Cluster, Bench]:
    t0 = time.monotonic()
    cluster = _cluster(opts, model, layers, layout, workloads)
    try:
        for side in cluster.sides.values():
            cluster.start_side(side)
        for side in cluster.sides.values():
            # Four processes importing torch on two busy cores can take minutes.
            cluster.wait_ready(side, timeout=opts.start_timeout_s)
    except BaseException:
        cluster.close()
        raise
    p, d = cluster.sides["prefill"].params, cluster.sides["decode"].params
    b = Bench(cluster, PlanModel(p, d), raw, opts.poll_ms)
    # Warm-up: the handshake, and every page of the largest workload faulted in on both sides.
    pairs = b.requests(max(workloads, key=lambda w: sum(w)))
    try:
        b.run(pairs)
    finally:
        b.release(pairs)
    # The paths timed below, once byte-exact: numpy fill at P, every byte checked at D.
    pairs = b.requests(VERIFY_LENS)
    try:
        b.verified = sum(b.run(pairs, bulk=bulk, verify=True)[0].verified for bulk in (False, True))
    finally:
        b.release(pairs)
    _log(f"{model} x{layers} {layout}: up and warm in {time.monotonic() - t0:.1f}s")
    return cluster, b


def _point(
    opts: BenchOptions, raw: RawCeiling, pt: ScalePoint, all_failures: dict[str, Any]
) -> dict[str, Any]:
    """One scaled model: goodput and overlap at one prompt length, descriptors, failures."""
    lens = [pt.prompt_tokens] * pt.requests
    cluster, b = _open(opts, raw, pt.model, pt.layers, opts.layouts[0], [lens])
    try:
        g = _goodput(b, lens, 1)
        ov = _overlap(
            b, pt.prompt_tokens, opts.overlap_reps, opts.compute_ratio, opts.overlap_poll_ms
        )
    finally:
        _close(cluster)
    all_failures.update({f"{pt.model}/{k}": v for k, v in b.failures.items()})
    return {
        "model": pt.model,
        "layers": len(b.plans.layers),
        "groups": len(b.plans.p.config.groups),
        **g,
        "overlap": ov,
        "failures": len(b.failures),
        "verified": b.verified,
    }


def _close(cluster: Cluster) -> None:
    t0 = time.monotonic()
    cluster.close()
    _log(f"cluster stopped in {time.monotonic() - t0:.1f}s")


def run_bench(opts: BenchOptions, progress: Callable[[str], None] = _log) -> dict[str, Any]:
    """Run every section; returns the JSON-able report."""
    t_start = time.monotonic()
    main_lens = [opts.prompt_tokens] * opts.requests
    workloads = [main_lens, [max(opts.lengths)]] + [
        [max(16, opts.scale_tokens // n)] * n for n in opts.scale_requests
    ]
    report: dict[str, Any] = {
        "model": opts.model,
        "layers": opts.layers,
        "prefill_tp": opts.prefill_tp,
        "decode_tp": opts.decode_tp,
        "quick": opts.quick,
        "compute_ratio": opts.compute_ratio,
        "poll_ms": opts.poll_ms,
        "overlap_poll_ms": opts.overlap_poll_ms,
        "layouts": {},
    }
    all_failures: dict[str, Any] = {}
    with RawCeiling(opts.raw_bytes) as raw:
        for layout in opts.layouts:
            cluster, b = _open(opts, raw, opts.model, opts.layers, layout, workloads)
            try:
                sec: dict[str, Any] = {}
                progress(f"{layout}: goodput")
                sec["goodput"] = _goodput(
                    b, main_lens, opts.reps if layout == opts.layouts[0] else 1
                )
                progress(f"{layout}: overlap")
                first = layout == opts.layouts[0]
                # Later layouts once: they are here for their descriptors and overlap shape.
                reps = opts.overlap_reps if first else 1
                sec["overlap"] = [
                    _overlap(b, n, reps, opts.compute_ratio, opts.overlap_poll_ms)
                    for n in opts.lengths
                ]
                if first:
                    progress(f"{layout}: requests in flight")
                    sec["scale"] = _requests_sweep(b, opts)
                sec["verified"] = b.verified
                all_failures.update({f"{layout}/{k}": v for k, v in b.failures.items()})
            finally:
                _close(cluster)
            report["layouts"][layout] = sec
        points = []
        for pt in opts.points:
            try:
                points.append(_point(opts, raw, pt, all_failures))
                progress(f"point {pt.model} x{pt.layers}: done")
            except Exception as e:  # keep what the other sections measured
                progress(f"point {pt.model} x{pt.layers} failed: {type(e).__name__}: {e}")
                points.append({"model": pt.model, "layers": pt.layers, "error": str(e)})
        report["points"] = points
    report["failures_detail"] = dict(list(all_failures.items())[:10])
    report["failures"] = len(all_failures)
    report["wall_s"] = round(time.monotonic() - t_start, 1)
    return report
