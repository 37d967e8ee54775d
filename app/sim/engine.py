"""The simulated engine: one TP rank of a P or D instance as its own process.

It allocates its KV cache in shared memory, registers it with its sidecar over the engine link,
then obeys a driver (the demo, a benchmark or a test) over ZMQ with msgspec-JSON commands:
P ranks play the forward pass (per layer: write the deterministic fill, wait the compute time,
signal the layer); D ranks expect requests, wait for them and verify them byte-exact.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import msgspec
import numpy as np
import zmq

from app.engine_link.client import CacheParams, EngineLink
from app.kvcache.layout import RankLayout
from app.kvcache.specs import SpecKind
from app.sim.kv_io import state_block_index, verify_request, write_state, write_tokens
from app.transfer.protocol import RemoteTarget, Status


class SimRequest(msgspec.Struct):
    id: str
    prompt_len: int
    blocks: list[list[int]]
    remote: RemoteTarget | None = None


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


def _ids(req: SimRequest) -> tuple[np.ndarray, ...]:
    return tuple(np.asarray(b, np.int64) for b in req.blocks)


class SimEngine:
    def __init__(self, link: EngineLink, layout: RankLayout, params: CacheParams) -> None:
        self.link, self.layout, self.params = link, layout, params
        self.step = 0
        self.layers = [c.index for c in layout.config.model.layers]

    def info(self) -> dict[str, Any]:
        return {"epoch": self.link.epoch, "control_port": self.link.control_port,
                "num_blocks": self.layout.num_blocks, "rank": self.layout.rank}

    def _forward_layer(self, layer: int, slices: list[tuple[SimRequest, int, int]],
                       cmd: Command) -> None:
        g = self.layout.group(self.layout.placements[layer].group)
        for req, start, end in slices:
            ids = _ids(req)[g.index]
            if g.kind is SpecKind.MAMBA:
                if end >= req.prompt_len:
                    idx = state_block_index(ids.size, cmd.mamba_mode, cmd.num_spec)
                    write_state(self.layout, layer, int(ids[idx]), req.prompt_len - 1)
            else:
                write_tokens(self.layout, layer, ids, start, end)

    def prefill(self, cmd: Command) -> dict[str, Any]:
        """Admit, run the chunked forward pass layer by layer, wait until every send ended."""
        t0 = time.monotonic()
        admitted, refused = [], {}
        for req in cmd.requests:
            assert req.remote is not None
            try:
                self.link.add_send_request(req.id, req.prompt_len, _ids(req), req.remote,
                                           mamba_mode=cmd.mamba_mode, num_spec=cmd.num_spec)
                admitted.append(req)
            except Exception as e:  # reported back to the driver, the request is FAILED there
                refused[req.id] = str(e)
        longest = max((r.prompt_len for r in admitted), default=0)
        chunk = cmd.chunk or longest or 1
        last_layer_at = t0
        for start in range(0, longest, chunk):
            slices = [(r, start, min(start + chunk, r.prompt_len)) for r in admitted
                      if start < r.prompt_len]
            self.step += 1
            steps = [] if cmd.bulk else [(r.id, s, e) for r, s, e in slices]
            self.link.begin_step(self.step, steps)
            for layer in self.layers:
                self._forward_layer(layer, slices, cmd)
                if cmd.compute_ms:
                    time.sleep(cmd.compute_ms / 1e3)
                self.link.layer_ready(self.step, layer)
            last_layer_at = time.monotonic()
        if cmd.bulk and admitted:
            # Bulk: the whole prompt after the last layer (one more "step" of every layer).
            self.step += 1
            self.link.begin_step(self.step, [(r.id, 0, r.prompt_len) for r in admitted])
            for layer in self.layers:
                self.link.layer_ready(self.step, layer)
        done, failed = self._wait({r.id for r in admitted}, cmd.timeout_s, sending=True)
        failed.update({rid: {"status": "FAILED", "error": e, "blocks": []}
                       for rid, e in refused.items()})
        fin = self.link.get_finished()
        return {"done": done, "failed": failed, "bytes": fin.bytes,
                "descriptors": fin.descriptors, "seconds": time.monotonic() - t0,
                "last_layer_at": last_layer_at}

    def _wait(self, ids: set[str], timeout_s: float, *, sending: bool
              ) -> tuple[list[str], dict[str, Any]]:
        done: list[str] = []
        failed: dict[str, Any] = {}
        deadline = time.monotonic() + timeout_s
        while ids - set(done) - set(failed) and time.monotonic() < deadline:
            fin = self.link.get_finished()
            done += [r for r in (fin.sending if sending else fin.recving) if r in ids]
            for f in fin.failed:
                if f.request in ids:
                    failed[f.request] = {"status": Status(f.status).name, "error": f.error,
                                         "blocks": f.block_ids}
            time.sleep(0.005)
        for rid in ids - set(done) - set(failed):
            failed[rid] = {"status": "HUNG", "error": "no terminal state before the driver's "
                           "deadline", "blocks": []}
        return done, failed

    def expect(self, cmd: Command) -> dict[str, Any]:
        refused = {}
        for req in cmd.requests:
            try:
                self.link.expect_receive(req.id, req.prompt_len, _ids(req), cmd.prefill_tp,
                                         timeout_s=cmd.timeout_s)
            except Exception as e:
                refused[req.id] = str(e)
        return {"refused": refused}

    def wait(self, cmd: Command) -> dict[str, Any]:
        t0 = time.monotonic()
        done, failed = self._wait({r.id for r in cmd.requests}, cmd.timeout_s + 5,
                                  sending=False)
        arrived = time.monotonic()
        by_id = {r.id: r for r in cmd.requests}
        problems = {rid: verify_request(self.layout, _ids(by_id[rid]), by_id[rid].prompt_len,
                                        cmd.mamba_mode, cmd.num_spec) for rid in done}
        return {"done": done, "failed": failed, "arrived_at": arrived,
                "problems": {k: v for k, v in problems.items() if v},
                "verified": [k for k, v in problems.items() if not v],
                "seconds": arrived - t0}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="simulated engine rank (driven over ZMQ)")
    ap.add_argument("--sidecar", required=True, help="the sidecar's engine IPC endpoint")
    ap.add_argument("--driver", required=True, help="endpoint this engine binds for commands")
    ap.add_argument("--engine-id", required=True)
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--params", required=True, help="CacheParams as JSON")
    args = ap.parse_args(argv)
    params = msgspec.json.decode(args.params, type=CacheParams)
    link = EngineLink(args.sidecar, args.engine_id, args.rank)
    layout = link.allocate_kv_caches(params)
    try:
        link.register_kv_caches(params)
        engine = SimEngine(link, layout, params)
        sock = zmq.Context.instance().socket(zmq.REP)
        sock.linger = 0
        sock.bind(args.driver)
        while True:
            cmd = msgspec.json.decode(sock.recv(), type=Command)
            if cmd.cmd == "exit":
                sock.send(msgspec.json.encode({}))
                break
            handler = {"info": lambda c: engine.info(), "prefill": engine.prefill,
                       "expect": engine.expect, "wait": engine.wait}.get(cmd.cmd)
            try:
                out = handler(cmd) if handler else {"error": f"unknown command {cmd.cmd}"}
            except Exception as e:
                out = {"error": f"{type(e).__name__}: {e}"}
            sock.send(msgspec.json.encode(out))
    finally:
        link.close()


if __name__ == "__main__":
    sys.exit(main())
