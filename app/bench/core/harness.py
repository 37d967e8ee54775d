"""One benchmark cluster and how a run on it is timed: ``Bench`` and its ``RunResult``, with
the small helpers the runner shares."""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import msgspec

from app.bench.core.plans import PlanModel, Submit
from app.bench.core.raw import WAITS, RawCeiling
from app.kvcache.groups import NULL_BLOCK
from app.sim.cluster import Cluster
from app.sim.commands import SimRequest


def _log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _rss(pid: int) -> dict[str, int]:
    """Anonymous and total resident bytes of a process (the KV mapping is shared memory)."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, val = line.partition(":")
            if key in ("VmRSS", "RssAnon"):
                out[key] = int(val.split()[0]) * 1024
    return out


def _median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs)) if xs else 0.0


@dataclass
class RunResult:
    seconds: float
    admitted_s: float
    exposed_s: float
    nbytes: int
    descriptors: int
    failures: dict[str, Any]
    verified: int = 0
    engine_exposed_s: float = 0.0  # as D's engine saw it (its polling included)
    sidecar_timed: bool = False  # end taken from D's sidecar (admin API), not its engine

    @property
    def gbps(self) -> float:
        return self.nbytes / max(self.seconds, 1e-9) / 1e9


@dataclass
class Bench:
    """One cluster, its plan model and the shared raw ceiling."""

    cluster: Cluster
    plans: PlanModel
    raw: RawCeiling
    poll_ms: float
    runs: int = 0
    raw_calls: int = 0
    bytes_seen: int = 0
    desc_seen: int = 0
    failures: dict[str, Any] = field(default_factory=dict)
    verified: int = 0  # requests checked byte-exact at D (out of 6: layer-wise and bulk)

    def requests(self, lens: Sequence[int]) -> list[tuple[SimRequest, SimRequest]]:
        """Allocate blocks for ``lens`` prompts on both sides (ids renamed for every run)."""
        return self.cluster.make_requests(lens, prefix="bench")

    def release(self, pairs: Sequence[tuple[SimRequest, SimRequest]]) -> None:
        """Give the blocks back so the same workload gets the same ids again.

        ``Cluster.release`` appends ids in allocation order to a stack, which hands them out
        reversed next time (no contiguous runs): push them back in reverse instead.
        """
        for role, idx in (("prefill", 0), ("decode", 1)):
            alloc = self.cluster.sides[role].allocator
            assert alloc is not None
            alloc.free.extend(
                b
                for pair in reversed(pairs)
                for ids in reversed(pair[idx].blocks)
                for b in reversed(ids)
                if b != NULL_BLOCK
            )

    def _renamed(self, pr: SimRequest, dr: SimRequest, rid: str) -> tuple[SimRequest, SimRequest]:
        """Both sides of a request under a new id, decode's target signed for it anew: a
        target binds to the transfer it was signed for."""
        p = msgspec.structs.replace(pr, id=rid)
        if p.remote is not None:
            self.cluster.retarget(p, request_id=rid)
        return p, msgspec.structs.replace(dr, id=rid)

    def run(
        self,
        pairs: Sequence[tuple[SimRequest, SimRequest]],
        *,
        bulk: bool = False,
        compute_ms: float = 0.0,
        verify: bool = False,
        poll_ms: float | None = None,
    ) -> tuple[RunResult, list[Submit], int]:
        """One transfer of ``pairs`` under fresh request ids; with the sidecar's submits as
        planned here and the minimum descriptors for that send mode."""
        self.runs += 1
        pairs = [self._renamed(pr, dr, f"r{self.runs}-{pr.id}") for pr, dr in pairs]
        submits = self.plans.submits(pairs, bulk=bulk)
        min_desc = self.plans.min_descriptors(submits, across_layers=bulk)
        res = self.cluster.run(
            pairs,
            compute_ms=compute_ms,
            bulk=bulk,
            fill=verify,
            verify=verify,
            poll_ms=poll_ms or self.poll_ms,
            timeout_s=60,
            bulk_one_signal=True,
        )
        prefill, decode = res["prefill"]["ranks"], res["decode"]["ranks"]
        nbytes = sum(r["bytes"] for r in prefill)
        desc = sum(r["descriptors"] for r in prefill)
        failed: dict[str, Any] = {}
        for r in [*decode, *prefill]:
            for rid, f in r["failed"].items():
                failed.setdefault(rid, f)
        for r in decode:
            for rid, problems in r["problems"].items():
                failed.setdefault(rid, {"status": "CORRUPT", "error": "; ".join(problems[:3])})
        self.failures.update(failed)
        ids = [pr.id for pr, _ in pairs]
        verified = sum(all(i in r["verified"] for r in decode) for i in ids) if verify else 0
        # Complete at D = when D's sidecar ended the request. Its engine hears of it only at its
        # next poll, whose sleep over-runs by milliseconds while the transfer busies both cores.
        engine_end = res["decode"]["completed_at"]
        sidecar_end = self._sidecar_done_at(res, pairs)
        end = sidecar_end if sidecar_end is not None else engine_end
        out = RunResult(
            # From the first layer's signal: admission is the engine's cost, not the pipeline's.
            seconds=end - res["prefill"]["first_layer_at"],
            admitted_s=res["prefill"]["first_layer_at"] - res["started"],
            exposed_s=max(0.0, end - res["prefill"]["last_layer_at"]),
            engine_exposed_s=max(0.0, engine_end - res["prefill"]["last_layer_at"]),
            sidecar_timed=sidecar_end is not None,
            nbytes=nbytes - self.bytes_seen,
            descriptors=desc - self.desc_seen,
            failures=failed,
            verified=verified,
        )
        self.bytes_seen, self.desc_seen = nbytes, desc
        return out, submits, min_desc

    def _sidecar_done_at(
        self, res: dict[str, Any], pairs: Sequence[tuple[SimRequest, SimRequest]]
    ) -> float | None:
        """When D's sidecar ended the last of ``pairs``: its admin API gives each request's
        admission-to-final duration, D's engine by when it was admitted (so this errs late by
        at most one engine-link round trip); None if either is missing (no admin API)."""
        d = self.cluster.sides["decode"]
        expect_at = [r.get("expect_at", {}) for r in res["expect"]["ranks"]]
        ranks = [info["rank"] for info in d.info]
        latest = 0.0
        try:
            with httpx.Client(base_url=d.admin_url, timeout=5.0) as http:
                for pr, _ in pairs:
                    reply = http.get(f"/v1/requests/{pr.id}")
                    if reply.status_code != 200:
                        return None
                    entries = [e for e in reply.json()["entries"] if e["side"] == "recv"]
                    for e in entries:
                        at = expect_at[ranks.index(e["rank"])].get(pr.id)
                        if at is None or e["duration_s"] is None:
                            return None
                        latest = max(latest, at + e["duration_s"])
                    if not entries:
                        return None
        except (httpx.HTTPError, KeyError, ValueError):
            return None
        return latest

    def raw_write(
        self, submits: Sequence[Submit], by_wait: dict[str, list[float]] | None = None
    ) -> list[float]:
        """The submits as raw writes once per way of waiting (the first after idle pays TCP's
        ramp, so the order alternates); seconds per submit of the faster, GB/s of each into
        ``by_wait``."""
        self.raw_calls += 1
        nbytes = sum(s.nbytes for s in submits)
        best: list[float] = []
        for wait in WAITS if self.raw_calls % 2 else WAITS[::-1]:
            times = self.raw.write([s.lengths for s in submits], wait)
            if by_wait is not None:
                by_wait.setdefault(wait, []).append(nbytes / sum(times) / 1e9)
            if not best or sum(times) < sum(best):
                best = times
        return best

    def rss(self) -> dict[str, dict[str, int]]:
        out = {}
        for role, side in self.cluster.sides.items():
            assert side.sidecar is not None
            out[role] = _rss(side.sidecar.pid)
        return out
