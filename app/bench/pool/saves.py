"""What running pool stores cost (issue 54): ``python -m app.bench.pool.saves``.

On each tiny model with a window or a state (Gemma-3, Qwen3-Next; Llama, whose stores wait for
the end, as a control), a P/D pair with the KV pool and decode's answers stored serves
conversations straight to decode (one request at a time, ``think_s`` apart so that a store at
the end is over before the next request), with ``pool_save_every`` 0 (off: stores at the end
only) and the setting under test (on), in interleaved rounds A B B A ... (each round a fresh
pair, the same model files, the same workload). Per request:

* the step time: vLLM's own inter-token latency on decode (its histogram's sum over count, one
  request running, so one step a token);
* the pool bytes decode put (its sidecar's ``kvsidecar_pool_bytes_total{direction="put"}``),
  per generated token.

The step-time ratio on / off comes with a 95% bootstrap interval (requests resampled within
each arm).
"""

from __future__ import annotations

import argparse
import random
import re
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from tempfile import TemporaryDirectory

import httpx

from app.bench.core.host import LOOPBACK, host_record, vllm_args
from app.bench.core.result_file import write_result
from app.harness.engines import completion
from app.harness.local_pd import LocalPD
from app.harness.tiny_models import write_tiny_model

ARGS = {"qwen3next": ("--mamba-ssm-cache-dtype", "float32")}
_ITL = re.compile(r"^vllm:inter_token_latency_seconds_(sum|count)(?:\{[^}]*\})? (\S+)$", re.M)
_PUT = re.compile(r'^kvsidecar_pool_bytes_total\{direction="put"\} (\S+)$', re.M)


@dataclass(frozen=True)
class Workload:
    conversations: int = 2
    turns: int = 3
    first: int = 256  # the first prompt's tokens
    new: int = 32  # each later turn's new message
    answer: int = 128  # generated tokens a request (ignore_eos)
    think_s: float = 0.5


@dataclass(frozen=True)
class Sample:
    kind: str
    arm: str  # "off" or "on"
    round: int
    step_ms: float  # this request's mean inter-token latency on decode
    generated: int
    put_bytes: float  # what decode's stores put while it ran and after it, until the next


def _tokens(length: int, salt: int) -> list[int]:
    return [(i * 37 + salt * 101) % 1000 + 1 for i in range(length)]


def _itl(base: str) -> tuple[float, float]:
    text = httpx.get(f"{base}/metrics", timeout=10).text
    got = {"sum": 0.0, "count": 0.0}
    for m in _ITL.finditer(text):
        got[m.group(1)] += float(m.group(2))
    return got["sum"], got["count"]


def _put(admin: str) -> float:
    m = _PUT.search(httpx.get(f"{admin}/metrics", timeout=10).text)
    return float(m.group(1)) if m else 0.0


def run_round(
    model: Path,
    kind: str,
    work: Path,
    arm: str,
    save_every: int,
    rnd: int,
    w: Workload,
    engines: dict[str, dict[str, tuple[str, ...]]],
) -> list[Sample]:
    """One fresh pair, the whole workload (the first conversation's first turn warms up);
    its engines' args go into ``engines`` (the host record's)."""
    pd = LocalPD(
        model,
        work,
        kind=kind,
        pool=True,
        prefill_prefix_caching=True,
        decode_prefix_caching=True,
        extra_vllm_args=ARGS.get(kind, ()),
        connector_extra={"pool_save_answers": True, "pool_save_every": save_every},
    )
    pd.start()
    engines[f"{kind} {arm}"] = vllm_args(pd.commands)
    try:
        decode = pd.decode
        completion(decode.url, _tokens(64, 9999), 8, ignore_eos=True)  # warm-up, not counted
        out: list[Sample] = []
        for c in range(w.conversations):
            history: list[int] = []
            for t in range(w.turns):
                prompt = [*history, *_tokens(w.first if t == 0 else w.new, 100 * c + t)]
                time.sleep(w.think_s)
                s0, n0 = _itl(decode.url)
                p0 = _put(decode.admin)
                body = completion(decode.url, prompt, w.answer, timeout_s=300, ignore_eos=True)
                answer = list(body["choices"][0]["token_ids"])
                s1, n1 = _itl(decode.url)
                time.sleep(w.think_s)  # the store at the end runs after the answer
                put = _put(decode.admin) - p0
                out.append(Sample(kind, arm, rnd, 1e3 * (s1 - s0) / (n1 - n0), len(answer), put))
                history = [*prompt, *answer]
        return out
    finally:
        pd.close()


def ratio_interval(
    on: list[float], off: list[float], reps: int = 4000, seed: int = 0
) -> tuple[float, float, float]:
    """mean(on) / mean(off) and its 95% bootstrap interval (each arm resampled alone)."""
    rng = random.Random(seed)

    def mean_of(xs: list[float]) -> float:
        return statistics.fmean(rng.choices(xs, k=len(xs)))

    got = sorted(mean_of(on) / mean_of(off) for _ in range(reps))
    point = statistics.fmean(on) / statistics.fmean(off)
    return point, got[int(0.025 * reps)], got[int(0.975 * reps) - 1]


def summary(samples: list[Sample]) -> dict[str, dict[str, float]]:
    out = {}
    for kind in sorted({s.kind for s in samples}):
        arms = {a: [s for s in samples if s.kind == kind and s.arm == a] for a in ("off", "on")}
        steps = {a: [s.step_ms for s in v] for a, v in arms.items()}
        point, lo, hi = ratio_interval(steps["on"], steps["off"])
        per_token = {
            a: sum(s.put_bytes for s in v) / sum(s.generated for s in v) for a, v in arms.items()
        }
        out[kind] = {
            "step_ms_off": statistics.fmean(steps["off"]),
            "step_ms_on": statistics.fmean(steps["on"]),
            "ratio": point,
            "ratio_lo": lo,
            "ratio_hi": hi,
            "put_bytes_per_token_off": per_token["off"],
            "put_bytes_per_token_on": per_token["on"],
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kinds", default="gemma3,qwen3next", help="tiny models, comma-separated")
    ap.add_argument("--save-every", type=int, default=1, help="pool_save_every of the on arm")
    ap.add_argument("--pairs", type=int, default=1, help="ABBA blocks (2 rounds of each arm)")
    ap.add_argument("--answer", type=int, default=Workload.answer)
    ap.add_argument("--out", type=Path, default=None, help="JSON of every sample and the summary")
    a = ap.parse_args()
    w = Workload(answer=a.answer)
    samples: list[Sample] = []
    engines: dict[str, dict[str, tuple[str, ...]]] = {}
    with TemporaryDirectory(prefix="pool-saves-") as tmp:
        for kind in a.kinds.split(","):
            model = write_tiny_model(Path(tmp) / kind / "model", kind)
            order = ["off", "on", "on", "off"] * a.pairs
            for rnd, arm in enumerate(order):
                every = a.save_every if arm == "on" else 0
                work = Path(tmp) / kind / f"round-{rnd}"
                got = run_round(model, kind, work, arm, every, rnd, w, engines)
                samples += got
                ms = statistics.fmean(s.step_ms for s in got)
                print(f"{kind} round {rnd} {arm}: {ms:.2f} ms a step", flush=True)
    result = {"workload": asdict(w), "save_every": a.save_every, "summary": summary(samples)}
    for kind, s in result["summary"].items():
        print(
            f"{kind}: step {s['step_ms_off']:.2f} ms off, {s['step_ms_on']:.2f} ms on, ratio "
            f"{s['ratio']:.3f} [{s['ratio_lo']:.3f}, {s['ratio_hi']:.3f}]; pool bytes a "
            f"generated token {s['put_bytes_per_token_off']:.0f} off, "
            f"{s['put_bytes_per_token_on']:.0f} on"
        )
    if a.out is not None:
        result["samples"] = [asdict(s) for s in samples]
        write_result(a.out, result, host_record(engines=engines, link=LOOPBACK))


if __name__ == "__main__":
    main()
