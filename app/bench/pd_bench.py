"""``bench pd``'s run, inside the network namespace: both systems, references, trials, phases.

``python -m app.bench.pd_bench OPTIONS.json`` is what ``pd_netns`` runs in the namespace; it
writes ``pd.json`` to the output folder. One trial is one workload (1 prompt, or N at once) sent
to one system's front door, streamed; what it measures:

- ``ttft_ms``: client send → first streamed token, at the system's front door (its proxy).
- ``p_start_ms``: send → P's first scheduled step = (arrival at the tap before P − send) +
  P's arrival → first step (vLLM's own histograms on P: e2e − inference time, per request).
- ``p_prefill_ms``: P's scheduled → first token (vLLM's ``request_prefill_time`` on P).
- ``exposed_ms``: P done → D's KV landed; P done is when P's answer was back at the tap; landed
  is the D transfer agent's own stamp (kv-sidecar: D sidecar's recv record ended DONE;
  Mooncake: D's receiver marked the request finished, ``mooncake_peer``). Last of the trial's
  prompts for both. Negative: the KV was at D before P's answer was back (layer-wise).
- ``exposed_derived_ms``: P done (tap) → first token at the client: exposed plus D's last-token
  step and the answer's way back, the same work in both systems.
- ``bytes``: what P's transfer agent reported sending (kv-sidecar: P sidecar's send records;
  Mooncake: its sender's ``record_transfer``).
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from app.bench.pd_stats import (
    Workload,
    calibrate,
    default_burst,
    p_times,
    parse_histograms,
    summarize,
    trial_order,
)
from app.bench.pd_systems import SYSTEMS, System, start_systems, stop_systems
from app.connectors.local_pd import write_tiny_model

FULL_MODEL = {  # random-weight Llama: hidden 1024, 16 layers, 4 KV heads of 128, bf16
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "num_hidden_layers": 16,
    "max_position_embeddings": 16384,
}  # LocalPD's initializer range (0.5): with 0.1, near-tied logits flipped greedy tokens
QUICK_MODEL = {  # --quick: the same shape, smaller (4 layers, hidden 512)
    "hidden_size": 512,
    "intermediate_size": 1024,
    "head_dim": 64,
    "num_hidden_layers": 4,
    "max_position_embeddings": 4096,
}


@dataclass(frozen=True)
class PDOptions:
    workloads: tuple[Workload, ...] = (
        Workload(512),
        Workload(2048),
        Workload(8192),
        Workload(2048, 4),
    )
    reps: int = 5
    link: str = "both"  # unshaped | shaped | both
    rate_bps: float | None = None
    burst: int | None = None
    latency_ms: int = 100
    max_tokens: int = 16
    quick: bool = False
    out: str = "bench-pd-out"
    model: dict[str, Any] = field(default_factory=lambda: dict(FULL_MODEL))

    @classmethod
    def from_json(cls, text: str) -> PDOptions:
        d = json.loads(text)
        d["workloads"] = tuple(Workload(**w) for w in d["workloads"])
        return cls(**d)


def _seed(tokens: int, k: int) -> list[int]:
    # Distinct, deterministic prompts; the reference appends P's own first token (LocalPD).
    return [(i * 37 + k * 101 + tokens) % 1000 + 1 for i in range(tokens - 1)]


async def _stream(
    client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int
) -> dict[str, Any]:
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "return_token_ids": True,
    }
    sent, first, tokens = time.time(), None, list[int]()
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ids = json.loads(line[6:])["choices"][0].get("token_ids") or []
            if ids and first is None:
                first = time.time()
            tokens.extend(ids)
    return {"sent": sent, "first": first, "tokens": tokens}


async def _fire(url: str, prompts: Sequence[list[int]], max_tokens: int) -> list[dict[str, Any]]:
    async with httpx.AsyncClient(timeout=600) as client:
        return list(await asyncio.gather(*(_stream(client, url, p, max_tokens) for p in prompts)))


def _p_histograms(system: System) -> dict[str, tuple[float, float]]:
    return parse_histograms(httpx.get(f"{system.prefill}/metrics", timeout=10).text)


def run_trial(
    system: System, prompts: Sequence[list[int]], refs: Sequence[list[int]], max_tokens: int
) -> dict[str, Any]:
    """One workload on one system; every observation of it (see the module docstring)."""
    before = _p_histograms(system)
    t0 = time.time()
    answers = asyncio.run(_fire(system.front, prompts, max_tokens))
    deadline = time.monotonic() + 10
    while True:  # P's answer may be back after D's: wait for it (and P's stats) before reading
        taps = system.taps(t0, time.time())
        if len(taps) >= len(prompts) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    time.sleep(0.2)
    t1 = time.time()
    p = p_times(before, _p_histograms(system))
    moved = system.transfers(t0, t1)
    p_done = max((t["ended"] for t in taps), default=float("nan"))
    first = [a["first"] or float("nan") for a in answers]
    arrival = [t["arrived"] - t0 for t in taps] or [float("nan")]
    correct = [a["tokens"] == r for a, r in zip(answers, refs, strict=True)]
    landed = moved["landed"]
    return {
        "ttft_ms": 1e3
        * sum(f - a["sent"] for f, a in zip(first, answers, strict=True))
        / len(answers),
        "p_start_ms": 1e3 * (sum(arrival) / len(arrival) + p["arrival_to_step_s"]),
        "p_prefill_ms": 1e3 * p["prefill_s"],
        "exposed_ms": 1e3 * (max(landed) - p_done) if landed else float("nan"),
        "exposed_derived_ms": 1e3 * (max(first) - p_done),
        "bytes": moved["bytes"],
        "outputs_equal": all(correct),
        "transfers_landed": len(landed),
        "counted": all(correct) and len(landed) == len(prompts),
        "outputs": [a["tokens"] for a in answers],
        "transfer_records": moved["records"],  # what the agents said, for a second look
        # Mooncake only: P's request_finished as its connector saw it -> landed (the tap's
        # "P done" is later by P's answer's way back).
        "exposed_hook_ms": 1e3 * (max(landed) - max(moved["p_finished"]))
        if landed and moved["p_finished"]
        else float("nan"),
    }


def set_link(opts: PDOptions, rate_bps: float | None) -> dict[str, Any]:
    """Shape loopback (a token bucket) or take the shaping off; we are inside the namespace."""
    subprocess.run(["tc", "qdisc", "del", "dev", "lo", "root"], capture_output=True, check=False)
    if rate_bps is None:
        return {"link": "unshaped"}
    burst = opts.burst or default_burst(rate_bps)
    cmd = ["tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate", f"{int(rate_bps)}bit"]
    cmd += ["burst", str(burst), "latency", f"{opts.latency_ms}ms"]
    subprocess.run(cmd, check=True)
    print(f"shaped loopback: {' '.join(cmd)}", flush=True)
    return {
        "link": "shaped",
        "rate_bps": rate_bps,
        "burst": burst,
        "latency_ms": opts.latency_ms,
        "tc": cmd,
    }


def run_phase(
    opts: PDOptions,
    link: str,
    systems: Sequence[System],
    prompts: dict[Workload, list[list[int]]],
    refs: dict[Workload, list[list[int]]],
    reps: int,
) -> list[dict[str, Any]]:
    by_name = {s.name: s for s in systems}
    for s in systems:  # warm-up: handshakes, first-request paths; not counted
        w = opts.workloads[0]
        run_trial(s, prompts[w][:1], refs[w][:1], opts.max_tokens)
    out = []
    for trial in trial_order(opts.workloads, SYSTEMS, reps):
        w = trial.workload
        r = run_trial(by_name[trial.system], prompts[w], refs[w], opts.max_tokens)
        r |= {
            "link": link,
            "rep": trial.rep,
            "workload": w.name,
            "tokens": w.tokens,
            "concurrency": w.concurrency,
            "system": trial.system,
        }
        print(_line(r), flush=True)
        out.append(r)
    return out


def _line(r: dict[str, Any]) -> str:
    ok = (
        "ok"
        if r["counted"]
        else f"NOT COUNTED (outputs equal: {r['outputs_equal']}, landed {r['transfers_landed']})"
    )
    head = f"{r['link']:8} rep {r['rep']} {r['workload']:5} {r['system']:10}"
    times = "  ".join(
        f"{k.removesuffix('_ms')} {r[k]:.1f}"
        for k in ("ttft_ms", "p_start_ms", "p_prefill_ms", "exposed_ms", "exposed_derived_ms")
    )
    return f"{head} {times} ms  bytes {r['bytes']}  {ok}"


def run(opts: PDOptions) -> dict[str, Any]:
    out = Path(opts.out)
    work = out / "work"
    model = write_tiny_model(work / "model", "llama", overrides=opts.model)
    longest = max(w.tokens for w in opts.workloads) + opts.max_tokens + 64
    systems = start_systems(model, work, longest)
    try:
        sidecar = systems[0].pd
        prompts: dict[Workload, list[list[int]]] = {}
        refs: dict[Workload, list[list[int]]] = {}
        for w in opts.workloads:  # one engine alone, no transfer: the reference
            pairs = [
                sidecar.reference(_seed(w.tokens, k), opts.max_tokens) for k in range(w.concurrency)
            ]
            prompts[w] = [p for p, _ in pairs]
            refs[w] = [r for _, r in pairs]
        trials: list[dict[str, Any]] = []
        links: list[dict[str, Any]] = []
        cal: dict[str, Any] | None = None
        if opts.link in ("unshaped", "both") or (opts.rate_bps is None and opts.link == "shaped"):
            links.append(set_link(opts, None))
            reps = opts.reps if opts.link != "shaped" else 1  # shaped only: a calibration rep
            phase = run_phase(opts, "unshaped", systems, prompts, refs, reps)
            trials += phase if opts.link != "shaped" else []
            if opts.link != "unshaped" and opts.rate_bps is None:
                cal = calibrate(phase)
                print(_calibration_text(cal), flush=True)
        if opts.link in ("shaped", "both"):
            rate = opts.rate_bps or (cal or {}).get("rate_bps")
            links.append(set_link(opts, rate))
            trials += run_phase(opts, "shaped", systems, prompts, refs, opts.reps)
            set_link(opts, None)
        return {
            "options": asdict(opts) | {"workloads": [w.name for w in opts.workloads]},
            "links": links,
            "calibration": cal,
            "references": {w.name: refs[w] for w in opts.workloads},
            "trials": trials,
            "summary": summarize(trials, SYSTEMS),
            "not_counted": [
                {
                    k: t[k]
                    for k in (
                        "link",
                        "rep",
                        "workload",
                        "system",
                        "outputs_equal",
                        "transfers_landed",
                    )
                }
                for t in trials
                if not t["counted"]
            ],
            "logs": str(work),
        }
    finally:
        stop_systems(systems)


def _calibration_text(cal: dict[str, Any]) -> str:
    share = cal["share"]
    lines = [f"calibration (unshaped): rate = bytes*8 / ({share} * P prefill s), median of:"]
    for w, v in cal["per_workload"].items():
        mbit = v["rate_bps"] / 1e6
        lines.append(
            f"  {w}: {v['bytes']:.0f} B * 8 / ({share} * {v['prefill_s']:.3f} s)"
            f" = {mbit:.1f} Mbit/s"
        )
    lines.append(f"  -> rate {cal['rate_bps'] / 1e6:.1f} Mbit/s")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    opts = PDOptions.from_json(Path(args[0]).read_text())
    # SIGTERM from the parent (Ctrl-C, timeout) unwinds through the finally that stops engines.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    result = run(opts)
    (Path(opts.out) / "pd.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
