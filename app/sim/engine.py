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
import os
import signal
import sys
import time
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import zmq

from app.engine_link.client import EngineLink
from app.sim.commands import Command, SimRequest, request_block_ids, request_seed
from app.sim.kv_io import (
    changed_outside,
    outside_read_set,
    sentinel_fill,
    untouched,
    verify_prefix,
    verify_request,
)
from app.sim.rank_engine import DEFAULT_SENTINEL, SimEngine
from app.sim.ranks import CacheParams, SimKV, register_rank
from app.transfer.requests.stream import ALL_LAYERS

if TYPE_CHECKING:
    import httpx


class SimInstance:
    """Every TP rank of one instance in one process, stepping through layers in lockstep."""

    def __init__(self, engines: list[SimEngine]) -> None:
        self.engines = engines
        # Kept alive, as decode's connector keeps its router client: a client per post builds
        # an SSL context each time (~50 ms of CPU), which would pace the simulated flow.
        self._router: httpx.Client | None = None

    def info(self, cmd: Command) -> dict[str, Any]:
        return {"ranks": [e.info() for e in self.engines]}

    def set_targets(self, live: list[SimRequest], cmd: Command) -> None:
        """Decode's targets: through every rank's engine link (concurrent dispatch), or posted
        once per request to the sidecar's admin API, as decode's connector does (prefill
        first)."""
        if cmd.target_url is None:
            for e in self.engines:
                e.set_targets(live)
            return
        if self._router is None:
            import httpx  # only the prefill-first flow posts: most engines never load it

            limits = httpx.Limits(keepalive_expiry=2.0)  # before the admin API's 5 s idle
            self._router = httpx.Client(timeout=10, limits=limits)
        for req in live:
            assert req.remote is not None
            body = {"transfer_id": req.id, "target": msgspec.to_builtins(req.remote)}
            r = self._router.post(cmd.target_url, json=body)
            if r.status_code != 200:  # the sidecar ended the send; the driver hears of it
                print(f"target of {req.id} refused: {r.status_code} {r.text}", file=sys.stderr)

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
                e.guarded("begin_step", partial(e.begin, [] if cmd.bulk else slices), heard=False)
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
                if signals == cmd.target_after_layers:
                    self.set_targets(live, cmd)
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
                e.guarded("begin_step", partial(e.begin, whole), heard=False)
                if cmd.bulk_one_signal:
                    e.signal(ALL_LAYERS)
                    continue
                for layer in e.layers:
                    e.signal(layer)
        if cmd.target_after_layers > signals:  # decode later than the whole forward pass
            self.set_targets(live, cmd)
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
                    request_block_ids(by_id[rid]),
                    by_id[rid].prompt_len,
                    cmd.mamba_mode,
                    cmd.num_spec,
                    request_seed(by_id[rid]),
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
                    r.id: e.link.pool_save(r.id, r.tokens, request_block_ids(r), r.prompt_len - 1)
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
                loaded = e.link.pool_load(r.id, r.tokens, request_block_ids(r), hit)
                failed = [b for ids in loaded.failed_blocks for b in ids]
                problems = [] if failed else verify_prefix(e.layout, request_block_ids(r), hit)
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
                    [(request_block_ids(r), r.prompt_len, r.id in done) for r in cmd.requests],
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
                    e.layout, request_block_ids(r), r.prompt_len, cmd.mamba_mode, cmd.num_spec
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

    def hold(self, cmd: Command) -> dict[str, Any]:
        """Admit sends without decode's target on every rank and return at once: they wait
        for a target posted to the sidecar (tests of the prefill-first flow's admin path)."""
        held = msgspec.structs.replace(cmd, target_after_layers=max(cmd.target_after_layers, 0))
        return {"refused": [e.admit(held) for e in self.engines]}

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
        # The whole sidecar: imported only by the engines that host it (a start costs less).
        from app.config import SidecarSettings
        from app.service import InProcessAgent

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
            "hold": sim.hold,
        }
        while True:
            cmd = msgspec.json.decode(sock.recv(), type=Command)
            if cmd.cmd == "exit":
                # The driver's SIGTERM follows this reply at once: ignored from before the
                # reply, it cannot land between the loop and the clean-up below and cut it
                # short (seen once under load: an engine exited 0 with its segments left).
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
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
    # Everything that outlives the process was released above; the interpreter's own
    # teardown (a last garbage collection over torch's objects) took half a second of every
    # cluster's close.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
