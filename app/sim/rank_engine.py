"""``SimEngine``: one simulated engine rank (its engine link, its KV cache, its ledger); the
process hosting the ranks of an instance is ``app.sim.engine``."""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from typing import Any, TypeVar

import numpy as np

from app.engine_link.client import EngineLink, FinishedRequests
from app.errors import KVSidecarError
from app.kvcache.layout import RankLayout
from app.kvcache.specs import SpecKind
from app.sim.commands import Command, SimRequest, request_block_ids, request_seed
from app.sim.kv_io import (
    restore_sentinel,
    sentinel_fill,
    state_block_index,
    write_state,
    write_tokens,
)
from app.sim.ranks import CacheParams
from app.transfer.planning.planner import MambaMode
from app.transfer.wire.protocol import Status, StepSlice
from app.transfer.wire.target_auth import prompt_digest

T = TypeVar("T")
DEFAULT_SENTINEL = 0x5E471E1


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
            ids = request_block_ids(req)[g.index]
            if g.kind is SpecKind.MAMBA:
                if cmd.mamba_mode == "align":
                    bs = g.block_size
                    for b in range(start // bs, min(end, req.prompt_len - 1) // bs):
                        write_state(
                            self.layout, layer, int(ids[b]), (b + 1) * bs, request_seed(req)
                        )
                if end >= req.prompt_len:
                    idx = state_block_index(ids.size, cmd.mamba_mode, cmd.num_spec)
                    write_state(
                        self.layout, layer, int(ids[idx]), req.prompt_len - 1, request_seed(req)
                    )
            else:
                write_tokens(self.layout, layer, ids, start, end, request_seed(req))

    def admit(self, cmd: Command) -> dict[str, str]:
        refused = {}
        for req in cmd.requests:
            assert req.remote is not None
            try:
                self.link.add_send_request(
                    req.id,
                    req.prompt_len,
                    request_block_ids(req),
                    req.remote if cmd.target_after_layers < 0 else None,
                    mamba_mode=MambaMode(cmd.mamba_mode),
                    num_spec=cmd.num_spec,
                    traceparent=req.traceparent,
                    prompt_digest=prompt_digest(req.tokens),
                )
            except Exception as e:  # reported to the driver; the sidecar ended it FAILED
                refused[req.id] = str(e)
        self.refused.update(refused)
        return refused

    def set_targets(self, requests: list[SimRequest]) -> None:
        """Decode's targets for sends admitted without one (concurrent dispatch)."""
        for req in requests:
            assert req.remote is not None
            self.guarded("set_target", partial(self.link.set_target, req.id, req.remote))

    def begin(self, slices: list[tuple[SimRequest, int, int]]) -> None:
        self.step += 1
        self.link.begin_step(self.step, [StepSlice(r.id, s, e) for r, s, e in slices])

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
                    req.id,
                    req.prompt_len,
                    request_block_ids(req),
                    cmd.prefill_tp,
                    timeout_s=cmd.timeout_s,
                    traceparent=req.traceparent,
                )
                self.expected[req.id] = request_block_ids(req)
            except Exception as e:
                refused[req.id] = str(e)
            expect_at[req.id] = time.monotonic()
        self.refused.update(refused)
        return {"refused": refused, "expect_at": expect_at}
