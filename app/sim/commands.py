"""What a driver sends a simulated engine (msgspec JSON over ZMQ): ``Command`` and the
``SimRequest`` it carries, with what both sides derive from a request."""

from __future__ import annotations

import msgspec
import numpy as np

from app.sim.fill import request_salt
from app.transfer.wire.protocol import RemoteTarget


class SimRequest(msgspec.Struct):
    id: str
    prompt_len: int
    blocks: list[list[int]]
    remote: RemoteTarget | None = None
    tokens: list[int] = []  # token ids, for pool hashing
    traceparent: str | None = None  # W3C trace context passed on to the sidecar


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
    # prefill, concurrent dispatch: admit without decode's target and hand it over (SetTarget
    # on every rank) after this many (>= 1) layer signals; past the last, once the forward
    # pass ended. -1: the target comes with the admission (decode first).
    target_after_layers: int = -1
    # prefill first: post each target once to this URL (the prefill sidecar's admin API)
    # instead of SetTarget on every rank.
    target_url: str | None = None
    # untouched: the requests that ended DONE (they may have written their read sets only;
    # the others anything in their blocks); None: all of them.
    done: list[str] | None = None
    seed: int | None = None  # sentinel: the pattern's seed (default: the engine's own)


def request_seed(req: SimRequest) -> int:
    """Push requests fill per request; pool requests by position (their tokens are the key)."""
    return 0 if req.tokens else request_salt(req.id)


def request_block_ids(req: SimRequest) -> tuple[np.ndarray, ...]:
    return tuple(np.asarray(b, np.int64) for b in req.blocks)
