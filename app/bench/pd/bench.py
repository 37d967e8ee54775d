"""``bench pd``'s run, inside the network namespace: both systems, references, phases.

``python -m app.bench.pd.bench OPTIONS.json`` is what ``pd.netns`` runs in the namespace; it
writes ``pd.json`` to the output folder. A trial, what it measures and when it counts:
``core.trial``. Each phase (a link setting) first warms both systems up the same way (every
workload once each, not counted), then runs the trials: systems alternate trial by trial, the
first rotating; with ``aa`` set, one system is measured twice per round (``SYSTEM-aa``, the
same engines): the A/A ratio is the noise floor of every figure. With ``digest`` shares, one
kv-sidecar pair runs every arm: before each trial both sidecars are told the arm's
``kv_digest.share`` (``PUT /v1/kv_digest``), so arms differ by the share alone; each is
compared with the first.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import httpx

from app.bench.core.cores import Binding, binding, place_threads, placement_text
from app.bench.core.engine_dtype import DtypeChoice, engine_dtype
from app.bench.core.host import HostRecord, host_record, links_text, stack_engines
from app.bench.core.interleave import aa_name
from app.bench.core.link import calibration_text, set_link
from app.bench.core.models import FULL_MODEL
from app.bench.core.netns import FAILURE
from app.bench.core.result_file import write_result
from app.bench.core.stats import SIDECAR, SYSTEMS, calibrate_link
from app.bench.core.stop_signals import exit_on_signal
from app.bench.core.systems import (
    CPU_SCOPE,
    System,
    check_kv_memory,
    kv_cache_env,
    memory_total,
    start_systems,
    stop_systems,
)
from app.bench.core.trial import line, seed
from app.bench.pd.engine_deaths import engine_deaths
from app.bench.pd.footprint import measured_trial
from app.bench.pd.stats import Workload, against_base, summarize, trial_order
from app.errors import ConfigError, KVSidecarError
from app.harness.local_pd import LocalPD
from app.harness.tiny_models import LONG_POSITIONS, write_tiny_model
from app.harness.waits import probe_ladder


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
    regime: str = "shared"  # shared | dedicated (core.cores)
    aa: str | None = SIDECAR  # measured twice per round: the A/A noise floor; None: not
    # kv-sidecar at each ``kv_digest.share`` (``digest_name``, arms of one pair) instead of the
    # two systems; the first is the base the others are compared with (issue 51's cost).
    digest: tuple[float, ...] = ()

    @classmethod
    def from_json(cls, text: str) -> PDOptions:
        d = json.loads(text)
        d["workloads"] = tuple(Workload(**w) for w in d["workloads"])
        d["digest"] = tuple(d.get("digest", ()))
        return cls(**d)

    @property
    def systems(self) -> tuple[str, ...]:
        """The systems compared: kv-sidecar and MooncakeConnector, or the digest arms."""
        return tuple(digest_name(s) for s in self.digest) or SYSTEMS


def digest_name(share: float) -> str:
    """The kv-sidecar arm whose ``kv_digest.share`` is ``share``."""
    return f"digest-{share:g}"


def digest_arms(base: System, shares: Sequence[float]) -> list[System]:
    """``base`` (a kv-sidecar pair) as one arm per share, each setting its share on both
    sidecars before its trial (prefill's decides a push's digest; both draw the pool's)."""
    return [base.twin(digest_name(x), partial(set_digest_share, base, x)) for x in shares]


def set_digest_share(system: System, share: float) -> None:
    """``kv_digest.share`` on both of ``system``'s sidecars (the admin API; no token here)."""
    for inst in (system.pd.prefill, system.pd.decode):
        r = httpx.put(f"{inst.admin}/v1/kv_digest", json={"share": share}, timeout=10)
        r.raise_for_status()


def warm_up(
    opts: PDOptions,
    link: str,
    systems: Sequence[System],
    prompts: dict[Workload, list[list[int]]],
    refs: dict[Workload, list[dict[str, list[int]]]],
) -> list[dict[str, Any]]:
    """Every workload once on each system, in the trials' rotation (handshakes, first-request
    paths, buffers of each size, both systems alike); recorded, not counted."""
    out = []
    for trial in trial_order(opts.workloads, [s.name for s in systems], 1):
        w = trial.workload
        system = next(s for s in systems if s.name == trial.system)
        r = measured_trial(system, prompts[w], refs[w], opts.max_tokens)
        r |= {"link": link, "rep": -1, "workload": w.name, "system": trial.system}
        print("warm-up " + line(r), flush=True)
        out.append({k: v for k, v in r.items() if k not in ("transfer_records", "outputs")})
    return out


def run_phase(
    opts: PDOptions,
    link: str,
    systems: Sequence[System],
    prompts: dict[Workload, list[list[int]]],
    refs: dict[Workload, list[dict[str, list[int]]]],
    reps: int,
    b: Binding,
) -> dict[str, Any]:
    """One link setting: warm-up, threads placed again (the dedicated regime: threads started
    since, e.g. on the first request, go to the transfer core), then the trials."""
    warm = warm_up(opts, link, systems, prompts, refs)
    placement = place_threads(_groups(systems), b)
    measured = list(systems)
    if opts.aa is not None:
        twin = next(s for s in systems if s.name == opts.aa).twin(aa_name(opts.aa))
        measured.append(twin)
    by_name = {s.name: s for s in measured}
    out = []
    for trial in trial_order(opts.workloads, list(by_name), reps):
        w = trial.workload
        r = measured_trial(by_name[trial.system], prompts[w], refs[w], opts.max_tokens)
        r |= {
            "link": link,
            "rep": trial.rep,
            "workload": w.name,
            "tokens": w.tokens,
            "concurrency": w.concurrency,
            "system": trial.system,
        }
        print(line(r), flush=True)
        out.append(r)
    return {"trials": out, "warmup": warm, "placement": placement}


def _groups(systems: Sequence[System]) -> dict[str, list[int]]:
    out = {"bench client": [os.getpid()]}
    for s in systems:
        out |= s.process_groups()
    return out


def references(
    pd: LocalPD, workloads: Sequence[Workload], max_tokens: int
) -> tuple[dict[Workload, list[list[int]]], dict[Workload, list[dict[str, list[int]]]]]:
    """Prompts and, per prompt, both references (``core.stats.match_reference``) from one engine
    alone, no transfer: ``n-1`` (LocalPD.reference: the prompt is the seed plus the engine's
    own first token, the answer the rest of its generation) and ``n`` (the engine's answer to
    that whole prompt).

    Shortest first, after the probes of ``waits.probe_ladder``: each is a prefill measured on
    these engines, so every later wait (the next references', the trials') is bound from a
    measured prefill of a length near its own."""
    for n in probe_ladder(w.tokens for w in workloads):
        t0 = time.monotonic()
        pd.complete(pd.prefill.url, seed(n, PROBE_SEED), 1)
        print(f"prefill probe: {n} tokens in {time.monotonic() - t0:.1f} s", flush=True)
    prompts: dict[Workload, list[list[int]]] = {}
    refs: dict[Workload, list[dict[str, list[int]]]] = {}
    for w in sorted(workloads, key=lambda w: (w.tokens, w.concurrency)):
        pairs = [pd.reference(seed(w.tokens, k), max_tokens) for k in range(w.concurrency)]
        prompts[w] = [p for p, _ in pairs]
        refs[w] = [{"n-1": r, "n": pd.complete(pd.prefill.url, p, max_tokens)} for p, r in pairs]
    return prompts, refs


PROBE_SEED = 997  # the probes' prompts differ from every workload's (k < 997)


def check_fits(opts: PDOptions) -> int:
    """The engines' max-model-len for ``opts``: the longest prompt, its decoded tokens and a
    margin; a ``ConfigError`` (one line, before anything starts) past the model's positions."""
    longest = max(w.tokens for w in opts.workloads) + opts.max_tokens + 64
    positions = int(opts.model.get("max_position_embeddings", LONG_POSITIONS))
    if longest > positions:
        raise ConfigError(
            f"the longest prompt ({longest - opts.max_tokens - 64} tokens) plus {opts.max_tokens} "
            f"decoded and a 64-token margin needs {longest} positions; the bench model has "
            f"{positions}"
        )
    return longest


def run(opts: PDOptions) -> tuple[dict[str, Any], HostRecord]:
    out = Path(opts.out)
    work = out / "work"
    b = binding(opts.regime, os.sched_getaffinity(0))
    os.environ.update(b.env())  # core.netns sets it too; every process started here inherits it
    print(b.describe(), flush=True)
    longest = check_fits(opts)
    model = write_tiny_model(work / "model", "llama", overrides=opts.model)
    # The dedicated regime computes on one core: there bf16 emulation is chosen away (the
    # shared regime keeps the model's bf16, as its published figures were measured).
    dtype: DtypeChoice | None = engine_dtype() if opts.regime == "dedicated" else None
    if dtype is not None:
        print(dtype.describe(), flush=True)
    # Each engine's KV cache holds the longest prompt, or a concurrent workload's together.
    held = max(longest, *(w.concurrency * (w.tokens + opts.max_tokens) for w in opts.workloads))
    kv_env = kv_cache_env(opts.model, held, dtype.dtype if dtype else None)
    print(f"engines' KV cache: {kv_env['VLLM_CPU_KVCACHE_SPACE']} GiB each", flush=True)
    check_kv_memory(kv_env, memory_total())
    names = opts.systems
    started = start_systems(
        model,
        work,
        longest,
        dtype.dtype if dtype else None,
        names=(SIDECAR,) if opts.digest else names,
        engine_env=kv_env,
    )
    systems = digest_arms(started[0], opts.digest) if opts.digest else started
    try:
        placement = place_threads(_groups(systems), b)
        print(placement_text(placement), flush=True)
        prompts, refs = references(systems[0].pd, opts.workloads, opts.max_tokens)
        phases: list[dict[str, Any]] = []
        links: list[dict[str, Any]] = []
        cal: dict[str, Any] | None = None
        if opts.link in ("unshaped", "both") or (opts.rate_bps is None and opts.link == "shaped"):
            links.append(set_link(None))
            reps = opts.reps if opts.link != "shaped" else 1  # shaped only: a calibration rep
            phase = run_phase(opts, "unshaped", systems, prompts, refs, reps, b)
            if opts.link != "shaped":
                phases.append(phase)
            if opts.link != "unshaped" and opts.rate_bps is None:
                cal = calibrate_link(t for t in phase["trials"] if t["system"] in names)
                print(calibration_text(cal), flush=True)
        if opts.link in ("shaped", "both"):
            rate = opts.rate_bps or (cal or {}).get("rate_bps")
            links.append(set_link(rate, opts.burst, opts.latency_ms))
            phases.append(run_phase(opts, "shaped", systems, prompts, refs, opts.reps, b))
            set_link(None)
        trials = [t for ph in phases for t in ph["trials"]]
        aa = (opts.aa, aa_name(opts.aa)) if opts.aa is not None else None
        engines = stack_engines({s.name: s.pd for s in systems})
        host = host_record(engines=engines, link=links_text(links))
        return {
            "options": asdict(opts) | {"workloads": [w.name for w in opts.workloads]},
            "systems": list(names),
            "binding": b.as_dict()
            | {"placement": placement, "placement_by_phase": [ph["placement"] for ph in phases]},
            "links": links,
            "calibration": cal,
            "references": {w.name: refs[w] for w in opts.workloads},
            "cpu_scope": CPU_SCOPE,
            "engine_dtype": dtype.as_dict() if dtype else None,
            "aa": list(aa) if aa else None,
            "warmup": [x for ph in phases for x in ph["warmup"]],
            "trials": trials,
            "summary": summarize(trials, names, aa),
            "digest": against_base(trials, names[0], names[1:]) if opts.digest else None,
            "not_counted": [
                {k: t[k] for k in NOT_COUNTED_KEYS} for t in trials if not t["counted"]
            ],
            "logs": str(work),
        }, host
    finally:
        stop_systems(started)


NOT_COUNTED_KEYS = (
    "link",
    "rep",
    "workload",
    "system",
    "outputs_equal",
    "references_matched",
    "failed_loads",
    "d_computed_tokens",
    "transfers_landed",
)


def one_line(e: BaseException, limit: int = 600) -> str:
    """``e`` in one line: its first line, and its last where it has more (an engine's exit
    carries its log's tail, whose last line is what killed it)."""
    lines = [x.strip() for x in str(e).splitlines() if x.strip()] or [""]
    head = lines[0] if isinstance(e, KVSidecarError) else f"{type(e).__name__}: {lines[0]}"
    text = head if len(lines) == 1 else f"{head} ... {lines[-1]}"
    return text[:limit]


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    opts = PDOptions.from_json(Path(args[0]).read_text())
    exit_on_signal()
    try:
        result, host = run(opts)
    except (KVSidecarError, httpx.HTTPError) as e:
        # A run that cannot finish (a prompt too slow for its wait, an engine gone) says why in
        # one line, for the command to print; the engines' logs have the rest.
        why = one_line(e)
        if deaths := engine_deaths(Path(opts.out) / "work"):  # an engine gone says why: its log
            why = f"{why}; {'; '.join(deaths)}"
        (Path(opts.out) / FAILURE).write_text(why + "\n")
        print(f"bench pd did not finish: {why}", file=sys.stderr, flush=True)
        sys.exit(2)
    write_result(Path(opts.out) / "pd.json", result, host)


if __name__ == "__main__":
    main()
