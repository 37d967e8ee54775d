"""One fault against a real simulated P/D cluster, then the same four checks for every scenario.

A scenario starts requests (decode's whole KV cache already holds a sentinel pattern), injects
its fault, collects what both sides report, and calls ``Chaos.verify``:

1. every request reached exactly one terminal state on every rank of both sides: the engines'
   ledgers (each ``get_finished`` entry, or the engine's own FAILED once it gave up on a dead
   sidecar), or, for an engine that was killed, its sidecar's view (``/v1/requests/{id}``);
   ``lost`` counts requests with a rank that has none. Prefill never says DONE for a request
   decode did not complete;
2. decode's cache, compared byte by byte with the sentinel: a DONE request may have changed its
   read set only (and must hold it byte-exact), any other request anything in its blocks,
   nothing else may have changed (free blocks, the null block, tails, padding). Once decode's
   engine has been told a request ended other than DONE it frees the blocks and puts the
   sentinel back: a byte that lands there later (``late``) was written into blocks the next
   request may already own, and fails the check too;
3. every sidecar the scenario did not kill answers ``/livez`` with 200;
4. once the cluster closed, nothing of it is left in /dev/shm (KV segments of every engine
   generation, the socket folder). The cluster itself removes only what killed engines could
   not; an engine that exited cleanly must have removed its own.

Each scenario adds one row to ``ROWS``, which ``conftest.py`` prints at the end of the run.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from app.sim.cluster import Cluster
from app.sim.commands import Command, SimRequest
from app.sim.fill import request_salt
from app.sim.kv_io import changed_in_blocks, changed_outside, verify_request
from app.sim.side import Side

TERMINAL = ("DONE", "FAILED", "ABORTED", "EXPIRED")
# Prompt lengths in whole kernel blocks (16 tokens). The planner sends a partial last kernel
# block whole, so a prompt of 900 tokens also writes tokens 900-911 of decode's last block:
# outside the read set, and counted by check 2 (48,942 bytes for one such request here) even
# without a fault. The scenarios are about faults, so they keep clear of it.
LENS = [1024, 1024, 896]
SENTINEL = 0x5E471E1
ROLES = ("prefill", "decode")
SHORT = {"prefill": "P", "decode": "D"}

Pairs = list[tuple[SimRequest, SimRequest]]


@dataclass
class End:
    """One terminal state of a request on one rank of one side."""

    status: str
    at: float | None  # monotonic (the same clock in every process here)
    by: str  # "sidecar" (reported to the engine), "engine" (gave up), "refused", "admin"
    error: str = ""


@dataclass
class Row:
    scenario: str
    requests: int
    terminal: int
    lost: int
    changed: int | None  # None: not observable in this scenario (the outcome says why)
    seconds: float | None
    outcome: str
    failed: list[str] = field(default_factory=list)
    late: int | None = 0


ROWS: list[Row] = []


@dataclass
class Outcome:
    """What ``verify`` found; scenarios add their own expectations on top."""

    ends: dict[str, dict[tuple[str, int], list[End]]]  # request -> (role, rank) -> ends
    status: dict[str, dict[str, str]]  # role -> request -> status (all ranks agree) or mixed
    seconds: float | None  # fault -> last terminal state
    changed: int
    replies: dict[str, dict[str, Any]]

    def at(self, role: str, rid: str) -> float | None:
        """When the last rank of ``role`` ended ``rid``."""
        times = [e.at for (r, _), ends in self.ends[rid].items() if r == role for e in ends]
        return max((t for t in times if t is not None), default=None)


class Chaos:
    """A cluster under one fault, and the checks that follow it."""

    def __init__(self, cluster: Cluster, name: str) -> None:
        self.c = cluster
        self.name = name
        self.p, self.d = cluster.sides["prefill"], cluster.sides["decode"]
        self.pairs: Pairs = []
        self.fault_at: float | None = None
        self.awaiting: set[str] = set()  # roles whose engine owes the driver a reply
        self.replies: dict[str, dict[str, Any]] = {}
        self.engine_gone: set[str] = set()  # roles whose engine that ran the requests is dead
        self.sidecar_gone: set[str] = set()  # roles whose sidecar was killed or stopped
        self.decode_generation = 0  # the decode engine start that holds the requests' blocks
        self.notes: list[str] = []  # what the scenario adds to its row
        # decode requests of the same cluster that completed DONE after the fault (check 2
        # counts their read sets as written, and checks them byte-exact)
        self.after: list[SimRequest] = []
        # decode rank -> requests its engine freed (sentinel put back) after they failed
        self.released: dict[int, list[str]] = {}
        self.started_at = time.monotonic()
        self.driver_s = 60.0
        self.closed = False

    def side(self, role: str) -> Side:
        return self.c.sides[role]

    # ---- driving ---------------------------------------------------------------------------

    def start(
        self,
        lens: Sequence[int],
        *,
        deadline_s: float,
        chunk: int = 128,
        compute_ms: float = 40.0,
        prefix: str = "req",
        wait: bool = True,
        driver_s: float | None = None,
        drop_ended: bool = True,
        **prefill: Any,
    ) -> Pairs:
        """Expect at decode (``deadline_s`` is decode's deadline), start the chunked prefill
        (``compute_ms`` per layer), and have decode wait for them (``wait``). Prefill's engine
        asks its sidecar what ended before every chunk (vLLM calls ``get_finished`` every
        step) and stops computing those (``drop_ended``)."""
        self.pairs = self.c.make_requests(lens, prefix)
        self.decode_generation = self.d.generation
        self.driver_s = driver_s or deadline_s + 20
        d_reqs = [dr for _, dr in self.pairs]
        out = self.c.call(
            self.d,
            Command(cmd="expect", requests=d_reqs, timeout_s=deadline_s, prefill_tp=self.p.tp),
            30,
        )
        assert not any(r["refused"] for r in out["ranks"]), out
        self.c.send(
            self.p,
            Command(
                cmd="prefill",
                requests=[pr for pr, _ in self.pairs],
                chunk=chunk,
                compute_ms=compute_ms,
                timeout_s=self.driver_s,
                drop_ended=drop_ended,
                **prefill,
            ),
        )
        self.awaiting.add("prefill")
        self.started_at = time.monotonic()
        if wait:
            self.wait_decode()
        return self.pairs

    def wait_decode(self) -> None:
        reqs = [dr for _, dr in self.pairs]
        self.c.send(self.d, Command(cmd="wait", requests=reqs, timeout_s=self.driver_s))
        self.awaiting.add("decode")

    def wait_written(self, timeout_s: float = 60.0) -> None:
        """Until prefill's sidecar reports a layer of this scenario's requests landed at
        decode: a fault then falls mid-transfer on observed progress, however busy the
        machine (a fixed sleep placed it before the first write on a slow run)."""
        admin = f"http://127.0.0.1:{self.p.admin_port}"
        ids = [pr.id for pr, _ in self.pairs]
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for rid in ids:
                r = httpx.get(f"{admin}/v1/requests/{rid}", timeout=5)
                entries = r.json().get("entries", []) if r.status_code == 200 else []
                if any(g["layers_sent"] for e in entries for g in e["groups"]):
                    return
            time.sleep(0.02)
        raise AssertionError(f"{self.name}: no layer of {ids} landed within {timeout_s}s")

    def at_fault(self) -> float:
        self.fault_at = time.monotonic()
        return self.fault_at

    def signal_sidecar(self, role: str, sig: int) -> None:
        self.c.signal_sidecar(self.side(role), sig)
        if sig in (signal.SIGKILL, signal.SIGTERM):
            proc = self.side(role).sidecar
            assert proc is not None
            proc.wait(30)
            self.sidecar_gone.add(role)

    def kill_engine(self, role: str) -> None:
        self.c.kill_engines(self.side(role))
        self.engine_gone.add(role)
        self.awaiting.discard(role)

    def collect(self) -> dict[str, dict[str, Any]]:
        """The replies of the engines that were driven and are still alive."""
        for role in sorted(self.awaiting):
            self.replies[role] = self.c.recv(self.side(role), self.driver_s + 30)
        self.awaiting.clear()
        return self.replies

    # ---- the checks ------------------------------------------------------------------------

    def _ledger_ends(self, role: str, ids: set[str]) -> dict[str, dict[tuple[str, int], list[End]]]:
        out: dict[str, dict[tuple[str, int], list[End]]] = {rid: {} for rid in ids}
        ranks = self.c.call(self.side(role), Command(cmd="reports"), 60)["ranks"]
        for rank, r in enumerate(ranks):
            if role == "decode":
                self.released[rank] = [rid for rid in r["released"] if rid in ids]
            for rep in r["reports"]:
                if rep["id"] in ids:
                    end = End(rep["status"], rep["at"], rep["by"], rep["error"])
                    out[rep["id"]].setdefault((role, rank), []).append(end)
            for rid, err in r["refused"].items():
                if rid in ids and not out[rid].get((role, rank)):
                    out[rid][(role, rank)] = [End("FAILED", None, "refused", err)]
        return out

    def _admin_ends(
        self, role: str, ids: set[str], wait_s: float
    ) -> dict[str, dict[tuple[str, int], list[End]]]:
        """What a sidecar whose engine died says of each request (polled until terminal)."""
        side = self.side(role)
        kind = "send" if role == "prefill" else "recv"
        out: dict[str, dict[tuple[str, int], list[End]]] = {}
        deadline = time.monotonic() + wait_s
        for rid in sorted(ids):
            while True:
                asked = time.monotonic()
                resp = httpx.get(f"{side.admin_url}/v1/requests/{rid}", timeout=10)
                entries = (
                    [e for e in resp.json()["entries"] if e["side"] == kind]
                    if resp.status_code == 200
                    else []
                )
                ends: dict[tuple[str, int], list[End]] = {}
                for e in entries:
                    at = None
                    if e["duration_s"] is not None:
                        at = asked - e["age_s"] + e["duration_s"]
                    ends.setdefault((role, e["rank"]), []).append(
                        End(e["state"], at, "admin", e.get("error") or "")
                    )
                final = all(x.status in TERMINAL for xs in ends.values() for x in xs)
                if (ends and final) or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            out[rid] = ends
        return out

    def _decode_bytes(self, status: dict[str, str]) -> tuple[int, int, list[str]]:
        """Check 2, in this process, on decode's segments (alive or left by a killed engine):
        bytes changed outside, bytes written into blocks after decode's engine freed them,
        and what is wrong."""
        changed, late, problems = 0, 0, []
        blocks_of = {dr.id: [np.asarray(b, np.int64) for b in dr.blocks] for _, dr in self.pairs}
        for rank in range(self.d.tp):
            layout = self.c.attach(self.d, rank, self.decode_generation)
            assert self.c.spec.sentinel is not None
            freed = [blocks_of[rid] for rid in self.released.get(rank, [])]
            late += changed_in_blocks(layout, self.c.spec.sentinel, freed)
            reqs = []
            for dr in [dr for _, dr in self.pairs] + self.after:
                blocks = [np.asarray(b, np.int64) for b in dr.blocks]
                done = status.get(dr.id) == "DONE" or dr in self.after
                reqs.append((blocks, dr.prompt_len, done))
                if done:
                    wrong = verify_request(layout, blocks, dr.prompt_len, salt=request_salt(dr.id))
                    problems += [f"{dr.id} DONE but not byte-exact: {w}" for w in wrong]
            n, found = changed_outside(layout, self.c.spec.sentinel, reqs)
            changed += n
            problems += found
            del layout
        return changed, late, problems

    def verify(
        self,
        *,
        wait_s: float = 30.0,
        expect: Callable[[Outcome], list[str]] | None = None,
    ) -> Outcome:
        """Checks 1-4 (and the scenario's own ``expect``), one row in ``ROWS``, then assert."""
        failed: list[str] = []
        self.collect()
        ids = {pr.id for pr, _ in self.pairs}
        ends: dict[str, dict[tuple[str, int], list[End]]] = {rid: {} for rid in ids}
        for role in ROLES:
            part = (
                self._admin_ends(role, ids, wait_s)
                if role in self.engine_gone
                else self._ledger_ends(role, ids)
            )
            for rid, by_rank in part.items():
                ends[rid].update(by_rank)

        # 1. exactly one terminal state per request, rank and side
        ranks = [(role, r) for role in ROLES for r in range(self.side(role).tp)]
        lost, terminal, twice = [], [], []
        for rid in sorted(ids):
            got = ends[rid]
            if any(len(got.get(k, [])) > 1 for k in ranks):
                twice.append(rid)
            if all(got.get(k) and all(e.status in TERMINAL for e in got[k]) for k in ranks):
                terminal.append(rid)
            else:
                lost.append(rid)
        if lost:
            failed.append(
                "1: no terminal state for "
                + ", ".join(
                    f"{rid} on {[k for k in ranks if not ends[rid].get(k)]}" for rid in lost
                )
            )
        if twice:
            failed.append(f"1: more than one terminal state for {twice}: {_show(ends, twice)}")
        status = {role: _role_status(ends, role, ranks) for role in ROLES}
        claimed = [
            rid
            for rid in ids
            if status["prefill"][rid] == "DONE" and status["decode"][rid] != "DONE"
        ]
        if claimed:
            failed.append(f"1: prefill DONE but decode not for {sorted(claimed)}")
        times = [e.at for got in ends.values() for xs in got.values() for e in xs if e.at]
        origin = self.fault_at or self.started_at
        seconds = round(max(times) - origin, 2) if times else None

        # 2. nothing changed on decode outside the read sets; DONE requests byte-exact
        changed, late, problems = self._decode_bytes(status["decode"])
        if problems:
            failed.append("2: " + "; ".join(problems[:6]))
        if late:
            # Once decode's engine heard a request ended, its blocks are free (the next request
            # may have them): a write landing there is a write outside every request's blocks.
            failed.append(
                f"2: {late} bytes landed in blocks of {self.released} after decode's engine "
                "had been told those requests ended (and freed their blocks)"
            )

        # 3. the sidecars that were not killed still answer /livez
        for role in ROLES:
            if role in self.sidecar_gone:
                continue
            proc = self.side(role).sidecar
            if proc is None or proc.poll() is not None:
                failed.append(f"3: the {role} sidecar died (status {proc and proc.returncode})")
                continue
            try:
                code = httpx.get(f"{self.side(role).admin_url}/livez", timeout=10).status_code
            except httpx.HTTPError as e:
                code = repr(e)  # type: ignore[assignment]
            if code != 200:
                failed.append(f"3: the {role} sidecar answered /livez with {code}")

        outcome = Outcome(ends, status, seconds, changed, self.replies)
        if expect is not None:
            failed += expect(outcome)

        # 4. nothing left in /dev/shm once the cluster closed
        left = self.close()
        if left:
            failed.append(f"4: shared memory left behind: {left}")

        ROWS.append(
            Row(
                self.name,
                len(ids),
                len(terminal),
                len(lost),
                changed,
                seconds,
                "; ".join(
                    [f"{SHORT[r]} {_count(status[r])}{self._took(ends, r)}" for r in ROLES]
                    + self.notes
                ),
                failed,
                late,
            )
        )
        assert not failed, "\n".join(failed)
        return outcome

    def _took(self, ends: dict[str, dict[tuple[str, int], list[End]]], role: str) -> str:
        """`` by Xs``: when the last rank of ``role`` ended its last request (from the fault)."""
        known = [
            e.at
            for got in ends.values()
            for (r, _), xs in got.items()
            if r == role
            for e in xs
            if e.at is not None
        ]
        origin = self.fault_at or self.started_at
        return f" by {max(known) - origin:.1f}s" if known else ""

    def close(self) -> list[str]:
        """Close the cluster; what of it is left in /dev/shm: KV segments of any engine
        generation, the socket folder. (The simulated engines name their segments; other
        people's processes on this machine make their own files there.)"""
        if self.closed:
            return []
        self.closed = True
        self.c.close()
        mine = Path(self.c.tmp).name
        return sorted(n for n in os.listdir("/dev/shm") if n.startswith(mine))


def _role_status(
    ends: dict[str, dict[tuple[str, int], list[End]]],
    role: str,
    ranks: list[tuple[str, int]],
) -> dict[str, str]:
    out = {}
    for rid, got in ends.items():
        seen = {e.status for k in ranks if k[0] == role for e in got.get(k, [])}
        out[rid] = seen.pop() if len(seen) == 1 else "/".join(sorted(seen)) or "NONE"
    return out


def _count(status: dict[str, str]) -> str:
    counts: dict[str, int] = {}
    for s in status.values():
        counts[s] = counts.get(s, 0) + 1
    return " ".join(f"{s}x{n}" for s, n in sorted(counts.items()))


def _show(ends: dict[str, dict[tuple[str, int], list[End]]], ids: list[str]) -> str:
    return "; ".join(
        f"{rid}: "
        + ", ".join(f"{k}={[(e.status, e.by) for e in xs]}" for k, xs in ends[rid].items())
        for rid in ids
    )


def mapped_by(pid: int, prefix: str) -> list[str]:
    """/dev/shm names starting with ``prefix`` that process ``pid`` still maps."""
    try:
        lines = Path(f"/proc/{pid}/maps").read_text().splitlines()
    except OSError:
        return []
    names = {ln.split("/dev/shm/", 1)[1].split()[0] for ln in lines if "/dev/shm/" in ln}
    return sorted(n for n in names if n.startswith(prefix))


def metric_sum(admin_url: str, word: str, socket: str) -> float:
    """Sum of every sample whose metric name contains ``word`` and that is labelled
    ``socket="<socket>"`` (the counter's exact name may change; what it counts may not)."""
    text = httpx.get(f"{admin_url}/metrics", timeout=10).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith("#") or word not in line.split("{", 1)[0]:
            continue
        if f'socket="{socket}"' in line and line.split("{", 1)[0].endswith("_total"):
            total += float(line.rsplit(" ", 1)[1])
    return total
