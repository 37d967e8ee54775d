"""``bench faults``'s pure logic: the options, the faults, each phase's seeded requests, when
goodput is back after a fault, and one phase's row of the table.

Goodput back (``goodput_back``): requests sent after the kill, in send order, in windows of
``window`` consecutive requests; goodput is back at the send time of the first request from
which every window starting within the next ``hold_s`` seconds has at least ``target`` of its
requests meeting the SLO (``core.slo.judge``). The time is counted from the kill.
"""

from __future__ import annotations

import json
import math
import random
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from app.bench.core.slo import ATTAINMENT, Slo, SloFactors, judge
from app.bench.core.workload import Lengths, schedule
from app.errors import ConfigError
from app.harness.kv_watch import BLOCK

CONTROL = "none"  # a phase under the same load, nothing killed: the baseline
FAULTS = ("prefill-vllm", "decode-vllm", "prefill-sidecar", "decode-sidecar", "master")
ENGINE_FAULTS = ("prefill-vllm", "decode-vllm")  # an engine start (tens of seconds) to wait out
QUICK_FAULTS = ("prefill-sidecar", "decode-sidecar", "master")
# Prompts ~384 tokens (64-1536) over 256-token steps: most take two or more steps, so a kill
# falls between a prompt's layers; outputs short enough to stay in the prompt's last block.
LENGTHS = Lengths(median=384, sigma=0.7, lo=64, hi=1536, out_lo=8, out_hi=32)
QUICK_LENGTHS = Lengths(median=256, sigma=0.7, lo=64, hi=1024, out_lo=8, out_hi=24)
MARGIN = 8  # tokens kept free at both ends of a prompt's last block (``snap_prompt``)


@dataclass(frozen=True)
class FaultOptions:
    faults: tuple[str, ...] = (CONTROL, *FAULTS)
    fraction: float = 0.7  # of the unloaded service rate (1 / unloaded service time)
    rate: float | None = None  # requests/s, given: ``fraction`` is then not used
    lengths: Lengths = field(default_factory=lambda: LENGTHS)
    repeat_share: float = 0.25  # requests that repeat an earlier prompt of the phase (pool hits)
    pre_s: float = 15.0  # load before the kill
    control_s: float = 75.0  # the control phase's load: as long as a sidecar or master phase
    after_s: float = 60.0  # most load after the kill (sidecar and master faults)
    engine_after_s: float = 120.0  # most load after the kill of an engine
    trigger_s: float = 10.0  # at most this long for a send in flight, then kill anyway
    window: int = 10  # requests per goodput window
    hold_s: float = 10.0  # goodput back: every window starting in this long after meets it
    drain_s: float = 60.0  # after the last send; still running then: cancelled, lost
    settle_s: float = 30.0  # for the sidecars to end every request after the drain
    calibration_reps: int = 2
    ref_concurrency: int = 4  # references computed this many at a time on prefill alone
    request_timeout_s: float = 120.0
    seed: int = 0
    quick: bool = False
    out: str = "bench-faults-out"
    slo: SloFactors = field(default_factory=SloFactors)

    @classmethod
    def from_json(cls, text: str) -> FaultOptions:
        d = json.loads(text)
        d["lengths"] = Lengths(**d["lengths"])
        d["slo"] = SloFactors(**d.get("slo", {}))
        d["faults"] = tuple(d["faults"])
        return cls(**d)

    def after(self, fault: str) -> float:
        """How long the load may go on after ``fault``'s kill at most."""
        return self.engine_after_s if fault in ENGINE_FAULTS else self.after_s

    def horizon_s(self) -> float:
        """Arrivals every phase has scheduled (the longest phase's); one sequence for all."""
        longest = max((self.after(f) for f in self.faults if f != CONTROL), default=0.0)
        return max(self.control_s, self.pre_s + longest)


def parse_faults(text: str) -> tuple[str, ...]:
    """``--faults a,b``: names of ``FAULTS`` (or ``none``), kept in the order given."""
    names = tuple(dict.fromkeys(x.strip() for x in text.split(",") if x.strip()))
    bad = [n for n in names if n not in (CONTROL, *FAULTS)]
    if bad or not names:
        raise ConfigError(
            f"--faults {text!r}: expected names among {', '.join((CONTROL, *FAULTS))}"
        )
    return names


def snap_prompt(tokens: int, max_tokens: int, lo: int = 1) -> int:
    """The longest prompt length ≤ ``tokens`` (≥ ``lo``) whose last block keeps ``MARGIN``
    tokens free before and ``max_tokens`` + ``MARGIN`` after its end: what decode generates then
    lands in the prompt's blocks, the ones its sidecar's record names."""
    top = BLOCK - max_tokens - MARGIN
    if top < MARGIN:
        raise ConfigError(f"{max_tokens} output tokens do not fit in one {BLOCK}-token block")

    def ok(n: int) -> bool:
        return MARGIN <= n % BLOCK <= top

    n = max(tokens, lo)
    while n >= lo and not ok(n):
        n -= 1
    if n >= lo:
        return n
    n = lo
    while not ok(n):
        n += 1
    return n


@dataclass(frozen=True)
class FaultRequest:
    index: int
    at_s: float  # send time after the phase's start
    prompt_tokens: int  # the whole prompt (seed plus the reference's first token)
    max_tokens: int
    prompt: int  # index of the request whose prompt this is (itself, or an earlier one)


def phase_requests(
    rate: float, duration_s: float, seed: int, lengths: Lengths, repeat_share: float
) -> tuple[FaultRequest, ...]:
    """Poisson arrivals (``core.workload.schedule``); each prompt snapped (``snap_prompt``),
    and with probability ``repeat_share`` the prompt of an earlier request instead."""
    if not 0 <= repeat_share < 1:
        raise ConfigError(f"repeat share {repeat_share}: expected 0 <= share < 1")
    rng = random.Random(seed + 1)  # its own stream: the arrivals stay schedule()'s
    out: list[FaultRequest] = []
    for r in schedule(rate, duration_s, seed, lengths):
        if out and rng.random() < repeat_share:
            first = out[out[rng.randrange(len(out))].prompt]
            out.append(
                FaultRequest(r.index, r.at_s, first.prompt_tokens, first.max_tokens, first.index)
            )
        else:
            n = snap_prompt(r.prompt_tokens, r.max_tokens, lengths.lo)
            out.append(FaultRequest(r.index, r.at_s, n, r.max_tokens, r.index))
    return tuple(out)


@dataclass(frozen=True)
class Point:
    """One request as the goodput windows see it."""

    sent: float
    ended: float | None  # None: still running
    good: bool


def goodput_back(
    points: Sequence[Point], kill_at: float, window: int, target: float, hold_s: float
) -> float | None:
    """Seconds from ``kill_at`` until goodput is back (the module docstring); None while no
    request qualifies yet (or, the load over, never did)."""
    after = sorted((p for p in points if p.sent >= kill_at), key=lambda p: p.sent)
    for i, p in enumerate(after):
        if not p.good and p.ended is not None:
            # A window may miss by the target share, but service is not back at a request
            # that missed: a run of good windows starting on one would date the return early.
            continue
        held = True
        k = i
        while k < len(after) and (k == i or after[k].sent <= p.sent + hold_s):
            chunk = after[k : k + window]
            if len(chunk) < window or any(q.ended is None for q in chunk):
                return None  # undecided: a later start's windows reach further still
            if sum(q.good for q in chunk) < target * window:
                held = False
                break
            k += 1
        if held:
            return p.sent - kill_at
    return None


def back_target(control_attainment: float | None) -> float:
    """The share a window must meet: ``ATTAINMENT`` of the control phase's (of 1 without)."""
    base = 1.0 if control_attainment is None else control_attainment
    return ATTAINMENT * base


@dataclass(frozen=True)
class FaultRow:
    """One phase of the table."""

    fault: str
    sent: int
    errors: int  # the client got an error (HTTP status, a broken stream) or a cut answer
    wrong: int  # answered in full, other than the reference
    lost: int  # no end at the client after the drain, or a record no sidecar ended
    changed_bytes: int | None  # on decode, outside every block a recv record named
    changed_blocks: int | None
    alone_blocks: int  # blocks of prompts decode served alone, which no record names
    back_s: float | None  # kill → goodput back; None: not within the load
    restart_s: float | None  # the restart call itself (engine serving, sidecar up, master up)
    attainment_before: float | None  # share meeting the SLO, sent before the kill
    attainment_after: float | None  # sent after the kill
    notes: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def outcome(answer: Mapping[str, Any], reference: Sequence[int] | None, slo: Slo) -> str:
    """``good`` / ``slow`` (answered as the reference, SLO missed) / ``wrong`` / ``error``
    / ``lost`` (cancelled at the drain: no end)."""
    err = answer.get("error")
    if err is not None:
        return "lost" if str(err).startswith("cancelled") else "error"
    tokens = list(answer.get("tokens") or ())
    if len(tokens) < answer["max_tokens"]:
        return "error"  # a stream cut short: the client saw no answer
    if reference is not None and tokens != list(reference):
        return "wrong"
    return "good" if judge(answer, slo)["good"] else "slow"


def _share(kinds: Sequence[str]) -> float | None:
    return sum(k == "good" for k in kinds) / len(kinds) if kinds else None


def fault_row(
    fault: str,
    answers: Sequence[Mapping[str, Any]],
    references: Mapping[int, Sequence[int]],
    slo: Slo,
    kill_at: float | None,
    *,
    window: int,
    target: float,
    hold_s: float,
    lost_records: int = 0,
    changed: tuple[int, int] | None = None,
    alone_blocks: int = 0,
    restart_s: float | None = None,
    notes: Sequence[str] = (),
) -> FaultRow:
    """A phase's row from its answers (each with ``index``, ``sent``, ``ended``, ``tokens``
    and ``stream``'s times) and their ``references`` by index; a good answer equals its
    reference and met the SLO. ``kill_at``: None for the control phase."""
    kinds = [outcome(a, references.get(a["index"]), slo) for a in answers]
    before = [
        k for a, k in zip(answers, kinds, strict=True) if kill_at is None or a["sent"] < kill_at
    ]
    after = [
        k
        for a, k in zip(answers, kinds, strict=True)
        if kill_at is not None and a["sent"] >= kill_at
    ]
    back = None
    if kill_at is not None:
        points = [
            Point(a["sent"], a.get("ended"), k == "good")
            for a, k in zip(answers, kinds, strict=True)
        ]
        back = goodput_back(points, kill_at, window, target, hold_s)
    return FaultRow(
        fault=fault,
        sent=len(answers),
        errors=kinds.count("error"),
        wrong=kinds.count("wrong"),
        lost=kinds.count("lost") + lost_records,
        changed_bytes=None if changed is None else changed[0],
        changed_blocks=None if changed is None else changed[1],
        alone_blocks=alone_blocks,
        back_s=back,
        restart_s=restart_s,
        attainment_before=_share(before),
        attainment_after=_share(after),
        notes=tuple(notes),
    )


def blocks_of(prompt_tokens: int, max_tokens: int) -> int:
    """Blocks a prompt and its answer fill on an engine that computes it alone."""
    return math.ceil((prompt_tokens + max_tokens) / BLOCK)


_POOL_LINE = re.compile(
    r'^kvsidecar_pool_(\w+?)(?:_total)?(?:\{(?:outcome|direction)="(\w+)"\})? (\S+)$', re.M
)


def pool_counts(metrics_text: str) -> dict[str, float]:
    """A sidecar's pool counters from its ``/metrics``: ``keys.put``, ``keys.failed``,
    ``saves``, ``bytes.get``, ... (a label's value after the dot)."""
    out: dict[str, float] = {}
    for m in _POOL_LINE.finditer(metrics_text):
        name, label, value = m.groups()
        if not name.endswith("_created"):
            out[f"{name}.{label}" if label else name] = float(value)
    return out


def _grew(x: Mapping[str, float], y: Mapping[str, float], name: str) -> float:
    # A restarted sidecar's counters start again from 0: what it counted since.
    before, after = x.get(name, 0.0), y.get(name, 0.0)
    return after - before if after >= before else after


def _delta(
    pool: Mapping[str, Mapping[str, Mapping[str, float]]], a: str, b: str
) -> dict[str, float]:
    """Keys stored, failed (errors and timeouts) and hit, both sidecars together, from
    snapshot ``a`` to ``b`` (a sidecar missing from either was down: left out)."""
    out = {"put": 0.0, "failed": 0.0, "hit": 0.0}
    for role in ("prefill", "decode"):
        x, y = pool.get(a, {}).get(role) or {}, pool.get(b, {}).get(role) or {}
        if x and y:
            out["put"] += _grew(x, y, "keys.put")
            out["failed"] += _grew(x, y, "keys.failed") + _grew(x, y, "keys.timeout")
            out["hit"] += _grew(x, y, "keys.hit")
    return out


def pool_note(pool: Mapping[str, Mapping[str, Mapping[str, float]]]) -> str | None:
    """What the pool did from the kill to the restart and after it (``pool_snapshot``s named
    ``kill``, ``restarted``, ``end``); whether keys were stored again after the restart."""
    if "restarted" not in pool or "end" not in pool:
        return None
    down, up = _delta(pool, "kill", "restarted"), _delta(pool, "restarted", "end")
    text = (
        f"pool, kill to restart: {down['put']:.0f} keys stored, {down['failed']:.0f} failed; "
        f"after: {up['put']:.0f} stored, {up['failed']:.0f} failed, {up['hit']:.0f} hit"
    )
    if up["put"] == 0 and up["failed"] > 0:
        text += " (the pool did not recover: nothing stored after the restart)"
    return text
