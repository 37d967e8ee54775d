"""The simulated engine: one TP rank of a P or D instance as its own process.

It allocates its KV cache in shared memory (``app.sim.ranks``), registers it as a vLLM worker
does (``RegisterEngine``), then obeys a driver (the demo, a benchmark or a test) over ZMQ
with msgspec-JSON commands: P ranks play the forward pass (per layer: write the deterministic
fill, wait the compute time, signal the layer); D ranks expect requests, wait for them and
verify them byte-exact.

For fault tests every rank keeps a ledger of the terminal states its sidecar reported (each
``get_finished`` entry, with the time it was seen), can fill its whole cache with a sentinel
pattern and count the bytes changed outside the requests' read sets, and aborts requests as
an engine would (``AbortRequest`` on the engine link). With ``--link-lease`` an engine whose
sidecar answered nothing for that long gives up on it and fails what it still waits for itself,
as a worker must when its sidecar is gone; without it a link error ends the command.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import numpy as np
import zmq

from app.config import SidecarSettings
from app.engine_link.client import EngineLink, FinishedRequests
from app.errors import KVSidecarError
from app.kvcache.layout import RankLayout
from app.kvcache.specs import SpecKind
from app.service import InProcessAgent
from app.sim.fill import request_salt
from app.sim.kv_io import (
    changed_outside,
    outside_read_set,
    restore_sentinel,
    sentinel_fill,
    state_block_index,
    untouched,
    verify_prefix,
    verify_request,
    write_state,
    write_tokens,
)
from app.sim.ranks import CacheParams, SimKV, register_rank
from app.transfer.agent import ALL_LAYERS
from app.transfer.planner import MambaMode
from app.transfer.protocol import RemoteTarget, Status


class SimRequest(msgspec.Struct):
    id: str
    prompt_len: int
    blocks: list[list[int]]
    remote: RemoteTarget | None = None
    tokens: list[int] = []  # token ids, for pool hashing


class Command(msgspec.Struct):
    cmd: str
    requests: list[SimRequest] = []
    chunk: int | None = None
    compute_ms: float = 0.0
    prefill_tp: int = 1
    timeout_s: float = 30.0
    mamba_mode: str = "none"
    num_spec: int = 0
    bulk: bool = False
    fill: bool = True  # False: skip writing the fill (benchmarks time the transfer, not numpy)
    verify: bool = True  # False: D skips the byte-exact check (benchmarks without the fill)
    poll_ms: float = 5.0  # D's get_finished polling interval in ``wait``: its timing resolution
    bulk_one_signal: bool = False  # bulk: one all-layers signal instead of one per layer
    # prefill: before each chunk, ask the sidecar what ended and stop computing requests that
    # ended on every rank (as a scheduler drops a request whose KV send failed or was aborted)
    drop_ended: bool = False
    # prefill: abort these requests (AbortRequest on every rank) right after the
    # ``abort_after_layers``-th layer signal, and leave them out of later chunks.
    abort: list[str] = []
    abort_after_layers: int = 1
    # untouched: the requests that ended DONE (they may have written their read sets only;
    # the others anything in their blocks); None: all of them.
    done: list[str] | None = None
    seed: int | None = None  # sentinel: the pattern's seed (default: the engine's own)


T = TypeVar("T")
DEFAULT_SENTINEL = 0x5E471E1


def _salt(req: SimRequest) -> int:
    """Push requests fill per request; pool requests by position (their tokens are the key)."""
    return 0 if req.tokens else request_salt(req.id)


def _ids(req: SimRequest) -> tuple[np.ndarray, ...]:
    return tuple(np.asarray(b, np.int64) for b in req.blocks)


class SimEngine:
    def __init__(
        self,
        link: EngineLink,
        layout: RankLayout,
        params: CacheParams,
        *,
        link_lease_s: float | None = None,
        sentinel: int | None = None,
    ) -> None:
        self.link, self.layout, self.params = link, layout, params
        self.step = 0
        self.layers = [c.index for c in layout.config.model.layers]
        # When the last get_finished answered (before the poll sleep): timing for benchmarks.
        self.seen_at = 0.0
        # Every terminal state the sidecar reported (or the engine decided, once it gave up on
        # its sidecar): {"id", "status", "error", "at" (monotonic), "by"}.
        self.reports: list[dict[str, Any]] = []
        self.refused: dict[str, str] = {}  # admission refusals (the call raised)
        self.link_lease_s = link_lease_s
        self.last_heard = time.monotonic()
        self.lost = ""  # why the engine gave up on its sidecar; empty while it has not
        self.sentinel = sentinel
        if sentinel is not None:
            sentinel_fill(layout, sentinel)
        # Decode: blocks of expected requests; once one ends other than DONE the engine frees
        # them, and (with a sentinel) puts the sentinel back, so a write that comes later
        # still shows (``kv_io.changed_in_blocks``).
        self.expected: dict[str, tuple[np.ndarray, ...]] = {}
        self.released: list[str] = []

    def guarded(self, what: str, fn: Callable[[], T], *, heard: bool = True) -> T | None:
        """Call the sidecar; with a link lease, a failure returns None (and gives up on the
        sidecar once nothing was heard from it for the lease) instead of raising."""
        if self.lost:
            return None
        try:
            out = fn()
        except KVSidecarError as e:
            if self.link_lease_s is None:
                raise
            silent = time.monotonic() - self.last_heard
            if silent >= self.link_lease_s:
                self.lost = f"sidecar silent for {silent:.1f}s ({what}: {e})"
            return None
        if heard:
            self.last_heard = time.monotonic()
        return out

    def signal(self, layer: int) -> None:
        """``layer_ready`` for the current step (one-way: queued, not an answer)."""
        self.guarded("layer_ready", partial(self.link.layer_ready, self.step, layer), heard=False)

    def poll(self) -> FinishedRequests | None:
        """``get_finished``, every entry of it written into the ledger."""
        fin = self.guarded("get_finished", self.link.get_finished)
        if fin is None:
            return None
        now = time.monotonic()
        for rid in [*fin.sending, *fin.recving]:
            self.reports.append(
                {"id": rid, "status": "DONE", "error": "", "at": now, "by": "sidecar"}
            )
        for f in fin.failed:
            self.reports.append(
                {
                    "id": f.request,
                    "status": Status(f.status).name,
                    "error": f.error,
                    "at": now,
                    "by": "sidecar",
                }
            )
        self.release([f.request for f in fin.failed])
        return fin

    def release(self, ids: list[str]) -> None:
        """Free the blocks of requests that ended other than DONE (sentinel back in them)."""
        ids = [r for r in ids if r in self.expected and r not in self.released]
        if ids and self.sentinel is not None:
            restore_sentinel(self.layout, self.sentinel, [self.expected[r] for r in ids])
            self.released += ids

    def info(self) -> dict[str, Any]:
        return {
            "epoch": self.link.epoch,
            "control_port": self.link.control_port,
            "num_blocks": self.layout.num_blocks,
            "rank": self.layout.rank,
        }

    def forward_layer(
        self, layer: int, slices: list[tuple[SimRequest, int, int]], cmd: Command
    ) -> None:
        """What attention / the state update writes for ``layer`` in this step.

        In ``align`` mode a state layer also checkpoints the state after every whole block it
        passes (vLLM keeps one per block there), which is what the KV pool stores and loads.
        """
        g = self.layout.group(self.layout.placements[layer].group)
        for req, start, end in slices:
            ids = _ids(req)[g.index]
            if g.kind is SpecKind.MAMBA:
                if cmd.mamba_mode == "align":
                    bs = g.block_size
                    for b in range(start // bs, min(end, req.prompt_len - 1) // bs):
                        write_state(self.layout, layer, int(ids[b]), (b + 1) * bs, _salt(req))
                if end >= req.prompt_len:
                    idx = state_block_index(ids.size, cmd.mamba_mode, cmd.num_spec)
                    write_state(self.layout, layer, int(ids[idx]), req.prompt_len - 1, _salt(req))
            else:
                write_tokens(self.layout, layer, ids, start, end, _salt(req))

    def admit(self, cmd: Command) -> dict[str, str]:
        refused = {}
        for req in cmd.requests:
            assert req.remote is not None
            try:
                self.link.add_send_request(
                    req.id,
                    req.prompt_len,
                    _ids(req),
                    req.remote,
                    mamba_mode=MambaMode(cmd.mamba_mode),
                    num_spec=cmd.num_spec,
                )
            except Exception as e:  # reported to the driver; the sidecar ended it FAILED
                refused[req.id] = str(e)
        self.refused.update(refused)
        return refused

    def begin(self, slices: list[tuple[SimRequest, int, int]]) -> None:
        self.step += 1
        self.link.begin_step(self.step, [(r.id, s, e) for r, s, e in slices])

    @staticmethod
    def absorb(
        fin: FinishedRequests,
        ids: set[str],
        sending: bool,
        done: list[str],
        failed: dict[str, Any],
    ) -> None:
        """Add what one ``get_finished`` reported of ``ids`` to ``done`` / ``failed``."""
        done += [r for r in (fin.sending if sending else fin.recving) if r in ids]
        for f in fin.failed:
            if f.request in ids:
                failed[f.request] = {
                    "status": Status(f.status).name,
                    "error": f.error,
                    "blocks": f.block_ids,
                }

    def wait_ids(
        self,
        ids: set[str],
        timeout_s: float,
        *,
        sending: bool,
        poll_s: float = 0.005,
        seen: tuple[list[str], dict[str, Any]] | None = None,
    ) -> tuple[list[str], dict[str, Any]]:
        """Poll ``get_finished`` until every id ended (or the driver's deadline); ``seen``:
        what earlier polls of this command already reported."""
        done: list[str] = list(seen[0]) if seen else []
        failed: dict[str, Any] = dict(seen[1]) if seen else {}
        deadline = time.monotonic() + timeout_s
        while ids - set(done) - set(failed) and time.monotonic() < deadline:
            fin = self.poll()
            if fin is None:
                if self.lost:
                    break
                time.sleep(poll_s)
                continue
            self.seen_at = time.monotonic()
            self.absorb(fin, ids, sending, done, failed)
            time.sleep(poll_s)
        for rid in sorted(ids - set(done) - set(failed)):
            if self.lost:
                # The worker's own decision: its sidecar is gone, so the request failed.
                error = f"engine gave up on its sidecar: {self.lost}"
                failed[rid] = {"status": "FAILED", "error": error, "blocks": []}
                self.reports.append(
                    {
                        "id": rid,
                        "status": "FAILED",
                        "error": error,
                        "at": time.monotonic(),
                        "by": "engine",
                    }
                )
                self.release([rid])
                continue
            failed[rid] = {
                "status": "HUNG",
                "error": "no terminal state before the driver's deadline",
                "blocks": [],
            }
        return done, failed

    def expect(self, cmd: Command) -> dict[str, Any]:
        refused = {}
        # By when the sidecar had admitted each (the call's return): timing for benchmarks.
        expect_at = {}
        for req in cmd.requests:
            if self.lost:
                refused[req.id] = f"engine gave up on its sidecar: {self.lost}"
                continue
            try:
                self.link.expect_receive(
                    req.id, req.prompt_len, _ids(req), cmd.prefill_tp, timeout_s=cmd.timeout_s
                )
                self.expected[req.id] = _ids(req)
            except Exception as e:
                refused[req.id] = str(e)
            expect_at[req.id] = time.monotonic()
        self.refused.update(refused)
        return {"refused": refused, "expect_at": expect_at}


class SimInstance:
    """Every TP rank of one instance in one process, stepping through layers in lockstep."""

    def __init__(self, engines: list[SimEngine]) -> None:
        self.engines = engines

    def info(self, cmd: Command) -> dict[str, Any]:
        return {"ranks": [e.info() for e in self.engines]}

    def prefill(self, cmd: Command) -> dict[str, Any]:
        """Admit on every rank, run the chunked forward pass, wait until every send ended."""
        t0 = time.monotonic()
        admitted = [e.admit(cmd) for e in self.engines]
        live = [r for r in cmd.requests if all(r.id not in refused for refused in admitted)]
        longest = max((r.prompt_len for r in live), default=0)
        chunk = cmd.chunk or longest or 1
        last_layer_at = t0
        first_layer_at: float | None = None
        signals, aborted_at = 0, None
        ids = {r.id for r in live}
        seen: list[tuple[list[str], dict[str, Any]]] = [([], {}) for _ in self.engines]
        for start in range(0, longest, chunk):
            ended: set[str] = set()
            if cmd.drop_ended:
                for e, (done, failed) in zip(self.engines, seen, strict=True):
                    fin = e.poll()
                    if fin is not None:
                        e.absorb(fin, ids, True, done, failed)
                ended = set.intersection(*({*d, *f} for d, f in seen))
            slices = [
                (r, start, min(start + chunk, r.prompt_len))
                for r in live
                if start < r.prompt_len
                and r.id not in ended
                and (aborted_at is None or r.id not in cmd.abort)
            ]
            if (cmd.drop_ended and not slices) or all(e.lost for e in self.engines):
                break  # nothing left to compute, or no sidecar left to tell
            for e in self.engines:
                e.guarded("begin_step", partial(e.begin, [] if cmd.bulk else slices))
            for layer in self.engines[0].layers:
                for e in self.engines:
                    if cmd.fill:
                        e.forward_layer(layer, slices, cmd)
                if cmd.compute_ms:
                    time.sleep(cmd.compute_ms / 1e3)
                if first_layer_at is None:
                    first_layer_at = time.monotonic()
                for e in self.engines:
                    e.signal(layer)
                signals += 1
                if cmd.abort and aborted_at is None and signals >= cmd.abort_after_layers:
                    # What vLLM's scheduler does on a client abort: the connector is told,
                    # and the request is not scheduled again.
                    for e in self.engines:
                        for rid in cmd.abort:
                            e.guarded("abort", partial(e.link.abort, rid, "aborted by engine"))
                    aborted_at = time.monotonic()
            last_layer_at = time.monotonic()
        if cmd.bulk and live:
            # Bulk: the whole prompt after the last layer, as one more pass of layer signals.
            whole = [(r, 0, r.prompt_len) for r in live]
            for e in self.engines:
                e.guarded("begin_step", partial(e.begin, whole))
                if cmd.bulk_one_signal:
                    e.signal(ALL_LAYERS)
                    continue
                for layer in e.layers:
                    e.signal(layer)
        ranks = []
        for e, refused, so_far in zip(self.engines, admitted, seen, strict=True):
            done, failed = e.wait_ids(ids, cmd.timeout_s, sending=True, seen=so_far)
            failed.update(
                {
                    rid: {"status": "FAILED", "error": err, "blocks": []}
                    for rid, err in refused.items()
                }
            )
            fin = e.poll()
            ranks.append(
                {
                    "done": done,
                    "failed": failed,
                    "bytes": fin.bytes if fin else 0,
                    "descriptors": fin.descriptors if fin else 0,
                }
            )
        return {
            "ranks": ranks,
            "seconds": time.monotonic() - t0,
            "last_layer_at": last_layer_at,
            "first_layer_at": first_layer_at or t0,
            "aborted_at": aborted_at,
        }

    def expect(self, cmd: Command) -> dict[str, Any]:
        return {"ranks": [e.expect(cmd) for e in self.engines]}

    def wait(self, cmd: Command) -> dict[str, Any]:
        ids = {r.id for r in cmd.requests}
        deadline = time.monotonic() + cmd.timeout_s + 5
        results = [
            e.wait_ids(
                ids, max(0.0, deadline - time.monotonic()), sending=False, poll_s=cmd.poll_ms / 1e3
            )
            for e in self.engines
        ]
        arrived = time.monotonic()
        by_id = {r.id: r for r in cmd.requests}
        ranks = []
        for e, (done, failed) in zip(self.engines, results, strict=True):
            problems = {
                rid: verify_request(
                    e.layout,
                    _ids(by_id[rid]),
                    by_id[rid].prompt_len,
                    cmd.mamba_mode,
                    cmd.num_spec,
                    _salt(by_id[rid]),
                )
                for rid in (done if cmd.verify else [])
            }
            ranks.append(
                {
                    "done": done,
                    "failed": failed,
                    "problems": {k: v for k, v in problems.items() if v},
                    "verified": [k for k, v in problems.items() if not v],
                    "unverified": [] if cmd.verify else done,
                }
            )
        seen = max((e.seen_at for e in self.engines), default=arrived)
        return {"ranks": ranks, "arrived_at": arrived, "completed_at": min(seen, arrived)}

    def pool_save(self, cmd: Command) -> dict[str, Any]:
        """After prefill: store each request's fully computed blocks (``prompt_len - 1``
        tokens, the state convention) in the pool; every rank its own shard."""
        return {
            "ranks": [
                {
                    r.id: e.link.pool_save(r.id, r.tokens, _ids(r), r.prompt_len - 1)
                    for r in cmd.requests
                }
                for e in self.engines
            ]
        }

    def pool_load(self, cmd: Command) -> dict[str, Any]:
        """Before decode: look each request up, load the hit, verify what was loaded."""
        ranks = []
        for e in self.engines:
            out = {}
            for r in cmd.requests:
                hit = e.link.pool_lookup(r.id, r.tokens)
                loaded = e.link.pool_load(r.id, r.tokens, _ids(r), hit)
                failed = [b for ids in loaded.failed_blocks for b in ids]
                problems = [] if failed else verify_prefix(e.layout, _ids(r), hit)
                out[r.id] = {
                    "hit_tokens": hit,
                    "loaded": loaded.loaded,
                    "bytes": loaded.bytes,
                    "failed_blocks": loaded.failed_blocks,
                    "problems": problems,
                }
            ranks.append(out)
        return {"ranks": ranks}

    def untouched(self, cmd: Command) -> dict[str, Any]:
        """Nothing outside the requests' read sets was written (free blocks, the null block,
        tails, pre-window blocks, non-final state blocks).

        After a sentinel fill every byte of the cache is compared (padding and gaps no view
        shows included); ``cmd.done`` then names the requests that ended DONE, which may have
        written their read sets only, while the others may have written anything in their
        blocks. ``changed`` counts the bytes changed outside.
        """
        if all(e.sentinel is not None for e in self.engines):
            done = {r.id for r in cmd.requests} if cmd.done is None else set(cmd.done)
            changed, problems = 0, []
            for e in self.engines:
                assert e.sentinel is not None
                n, found = changed_outside(
                    e.layout,
                    e.sentinel,
                    [(_ids(r), r.prompt_len, r.id in done) for r in cmd.requests],
                    cmd.mamba_mode,
                    cmd.num_spec,
                )
                changed += n
                problems += found
            return {"problems": problems, "changed": changed}
        used = {b for r in cmd.requests for ids in r.blocks for b in ids}
        problems = [p for e in self.engines for p in untouched(e.layout, used)]
        for e in self.engines:
            for r in cmd.requests:
                found = outside_read_set(
                    e.layout, _ids(r), r.prompt_len, cmd.mamba_mode, cmd.num_spec
                )
                problems += [f"{r.id}: {p}" for p in found]
        return {"problems": problems}

    def sentinel(self, cmd: Command) -> dict[str, Any]:
        """Fill every byte of every rank's cache with the sentinel pattern (before a run)."""
        t0 = time.monotonic()
        for e in self.engines:
            e.sentinel = cmd.seed if cmd.seed is not None else (e.sentinel or DEFAULT_SENTINEL)
            sentinel_fill(e.layout, e.sentinel)
        return {"seconds": time.monotonic() - t0, "seed": self.engines[0].sentinel}

    def abort(self, cmd: Command) -> dict[str, Any]:
        """Abort requests on every rank, as the engine's scheduler would (``AbortRequest``)."""
        for e in self.engines:
            for r in cmd.requests:
                e.guarded("abort", partial(e.link.abort, r.id, "aborted by engine"))
        return {"aborted_at": time.monotonic()}

    def reports(self, cmd: Command) -> dict[str, Any]:
        """Each rank's ledger of terminal states, after one more poll of its sidecar."""
        for e in self.engines:
            e.poll()
        return {
            "ranks": [
                {"reports": e.reports, "refused": e.refused, "lost": e.lost, "released": e.released}
                for e in self.engines
            ]
        }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="simulated engine ranks (driven over ZMQ)")
    ap.add_argument("--sidecar", required=True, help="the sidecar's engine IPC endpoint")
    ap.add_argument("--driver", required=True, help="endpoint this process binds for commands")
    ap.add_argument("--engine-id", required=True)
    ap.add_argument("--ranks", default="0", help="TP ranks hosted here, e.g. 0,1")
    ap.add_argument("--params", required=True, help="CacheParams as JSON")
    ap.add_argument("--shm-prefix", default=None, help="name prefix of the KV segments")
    ap.add_argument(
        "--sentinel", type=int, default=None, help="fill the whole cache with this pattern first"
    )
    ap.add_argument(
        "--link-timeout", type=float, default=10.0, help="seconds per call to the sidecar"
    )
    ap.add_argument(
        "--link-lease",
        type=float,
        default=None,
        help="give up on a sidecar silent this long (fail what is pending); default: never",
    )
    ap.add_argument(
        "--in-process",
        action="store_true",
        help="host the agent in this process (settings from KVSIDECAR_* in the environment)",
    )
    args = ap.parse_args(argv)
    params = msgspec.json.decode(args.params, type=CacheParams)
    agent = None
    if args.in_process:
        agent = InProcessAgent(SidecarSettings())
        agent.start()
    # SIGTERM unwinds through the finally below, so the shared-memory names are removed.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    links = [
        EngineLink(
            args.sidecar,
            args.engine_id,
            int(r),
            timeout_s=args.link_timeout,
            shm_prefix=f"{args.shm_prefix}-r{r}" if args.shm_prefix else None,
        )
        for r in args.ranks.split(",")
    ]
    kvs: list[SimKV] = []
    try:
        for link in links:
            kvs.append(register_rank(link, params))
        sim = SimInstance(
            [
                SimEngine(
                    link, kv.layout, params, link_lease_s=args.link_lease, sentinel=args.sentinel
                )
                for link, kv in zip(links, kvs, strict=True)
            ]
        )
        sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.REP)
        sock.linger = 0
        sock.bind(args.driver)
        handlers = {
            "info": sim.info,
            "prefill": sim.prefill,
            "expect": sim.expect,
            "wait": sim.wait,
            "untouched": sim.untouched,
            "pool_save": sim.pool_save,
            "pool_load": sim.pool_load,
            "sentinel": sim.sentinel,
            "abort": sim.abort,
            "reports": sim.reports,
        }
        while True:
            cmd = msgspec.json.decode(sock.recv(), type=Command)
            if cmd.cmd == "exit":
                sock.send(msgspec.json.encode({}))
                break
            handler = handlers.get(cmd.cmd)
            try:
                out = handler(cmd) if handler else {"error": f"unknown command {cmd.cmd}"}
            except Exception as e:
                out = {"error": f"{type(e).__name__}: {e}"}
            sock.send(msgspec.json.encode(out))
    finally:
        # A SIGTERM now (the driver sends one right after "exit") must not cut the clean-up
        # short: segments not yet unlinked would stay in /dev/shm.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        for link in links:
            link.close()
        for kv in kvs:
            kv.close()
        if agent is not None:
            agent.stop()
        # A SIGTERM between a segment's creation and its recording in the arena (while
        # allocating) would leave that one behind: the names under our prefix are ours.
        for r in args.ranks.split(",") if args.shm_prefix else []:
            for f in Path("/dev/shm").glob(f"{args.shm_prefix}-r{r}-*"):
                f.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
