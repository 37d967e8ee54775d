"""Decode's KV cache watched from outside the engine: a copy of every block before and after a
run, the bytes that changed outside the blocks the sidecar's records name, and the proxy's
breakers waited shut. Used by the real-engine chaos tests and ``bench faults``."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import httpx
import numpy as np

from app.errors import DeadlineExceeded
from app.harness.local_pd import LocalPD

BLOCK = 128  # vLLM's CPU block size (checked against the registration)


class DecodeKV:
    """Decode's whole KV memory as some live process maps it (the engine unlinked its /dev/shm
    name once its sidecar mapped it), per layer and kernel block."""

    def __init__(self, admin: str, pids: Iterable[int]) -> None:
        reg = httpx.get(f"{admin}/v1/registration", timeout=10).json()["ranks"]["0"]
        (self.group,) = reg["groups"]  # the tiny Llama: one full-attention group
        assert self.group["block_size"] == self.group["kernel_block_size"] == BLOCK, self.group
        self.memory = reg["memory"]
        self.layers = reg["layers"]
        self.pids = list(pids)

    def _buffer(self, index: int) -> np.ndarray:
        name, start, size = self.memory[index]
        for pid in self.pids:
            try:
                maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
            except OSError:
                continue
            for line in maps:
                if f"/dev/shm/{name}" in line:
                    span = line.split()[0]
                    raw = np.memmap(f"/proc/{pid}/map_files/{span}", np.uint8, "r")
                    return np.asarray(raw[start : start + size])
        raise AssertionError(f"no live process of {self.pids} maps {name}")

    def blocks(self) -> list[np.ndarray]:
        """A copy of every layer as ``[blocks, bytes per block]``."""
        out = []
        for layer in self.layers:
            axes = layer["axes"]
            itemsize = 2 if layer["dtype"] in ("bfloat16", "float16") else 4
            assert axes[0][0] == "block" and axes[0][2] == int(np.prod([a[1] for a in axes[1:]])), (
                axes
            )  # blocks outermost and dense: a block is one byte range
            per = axes[0][2] * itemsize
            buf = self._buffer(layer["buffer"])
            out.append(buf[layer["offset"] : layer["offset"] + axes[0][1] * per].reshape(-1, per))
        return [np.array(b) for b in out]


def changed_outside(
    before: list[np.ndarray], after: list[np.ndarray], inside: set[int]
) -> tuple[int, int]:
    """Bytes that differ in kernel blocks not in ``inside``, and how many such blocks."""
    total = 0
    blocks = np.zeros(len(after[0]), bool)
    for b, a in zip(before, after, strict=True):
        per_block = (a != b).sum(axis=1)
        mask = np.ones(len(per_block), bool)
        mask[sorted(inside)] = False
        total += int(per_block[mask].sum())
        blocks |= mask & (per_block > 0)
    return total, int(blocks.sum())


def close_breaker(
    pd: LocalPD, role: str, probe: Callable[[int], Sequence[int]], timeout_s: float = 60.0
) -> None:
    """Wait until the proxy's breaker of ``role`` is closed with no failure counted. A fault
    leaves failures there: an open or half-open breaker answers concurrent requests 503 (one
    trial request at a time), so a trial request (``probe(i)``: a prompt long enough for the
    proxy to send it through prefill) is sent whenever the breaker lets one through."""
    deadline = time.monotonic() + timeout_s
    for i in range(10_000):
        (state,) = httpx.get(f"{pd.proxy}/health", timeout=5).json()[role]
        if state["breaker"] == "closed" and state["consecutive_failures"] == 0:
            return
        if time.monotonic() >= deadline:
            raise DeadlineExceeded(f"the proxy's {role} breaker stays {state}")
        if state["breaker"] != "open":
            with contextlib.suppress(httpx.HTTPError):
                pd.completion(pd.proxy, probe(i), 1, timeout_s=60)
        time.sleep(0.5)
