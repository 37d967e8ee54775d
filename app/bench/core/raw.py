"""The raw ceiling: the same bytes, in descriptors of the same sizes, as plain Mooncake writes.

The bench process registers a source buffer with two ``MooncakeEngine``s (the wrapper the
sidecar uses, so the per-call descriptor limit is the same), one per way of waiting (polled
single-descriptor transfers, the sidecar's default, and the engine's busy-spinning batch calls),
and writes into a peer process's buffer: two processes over loopback TCP, no planner, no event
loop, no control plane.
"""

from __future__ import annotations

import json
import mmap
import subprocess
import sys
import time
from collections.abc import Sequence
from types import TracebackType

import numpy as np

from app.errors import TransferError
from app.transfer.lanes.mooncake import EngineConfig, MooncakeEngine, Wait

WAITS: tuple[Wait, ...] = ("poll", "spin")


class RawCeiling:
    """A peer process with a ``size``-byte target and a local source of the same size."""

    def __init__(self, size: int, *, max_descriptors_per_submit: int = 1024) -> None:
        self.size = size
        self._peer = subprocess.Popen(
            [sys.executable, "-m", "app.bench.core.peer", str(size)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
        self._mm = mmap.mmap(-1, size)
        self._src = np.frombuffer(self._mm, dtype=np.uint8)
        self._src[::4096] = 1  # prefault, as the peer does
        self.engines: dict[Wait, MooncakeEngine] = {}
        for wait in WAITS:
            eng = MooncakeEngine(
                EngineConfig(
                    spin_threads=1, max_descriptors_per_submit=max_descriptors_per_submit, wait=wait
                )
            )
            self.engines[wait] = eng
            eng.register(int(self._src.ctypes.data), size)
        assert self._peer.stdout is not None
        line = self._peer.stdout.readline()
        if not line:
            self.close()
            raise TransferError("raw-ceiling peer exited before reporting its session")
        info = json.loads(line)
        self.session: str = info["session"]
        self.addr: int = int(info["addr"])

    def write(self, submits: Sequence[np.ndarray], wait: Wait = "poll") -> list[float]:
        """Write each submit (an array of descriptor lengths) back to back, waiting the ``wait``
        way; seconds per submit.

        Descriptors are laid end to end in both buffers (each stays a descriptor of its own
        size: the engine does not merge them); a submit that does not fit in what is left of
        the buffers starts again at their beginning.
        """
        src0 = np.uint64(self._src.ctypes.data)
        dst0 = np.uint64(self.addr)
        times = []
        off = 0
        for lengths in submits:
            ln = np.asarray(lengths, dtype=np.uint64)
            nbytes = int(ln.sum())
            if nbytes > self.size:
                raise TransferError(
                    f"raw ceiling: one submit of {nbytes} bytes, the buffers hold {self.size}"
                )
            if off + nbytes > self.size:
                off = 0
            rel = np.uint64(off) + np.concatenate(([0], np.cumsum(ln)[:-1])).astype(np.uint64)
            t0 = time.monotonic()
            self.engines[wait].write_sync(self.session, src0 + rel, dst0 + rel, ln)
            times.append(time.monotonic() - t0)
            off += nbytes
        return times

    def close(self) -> None:
        stop_peer(self._peer, 10)
        for eng in getattr(self, "engines", {}).values():
            eng.close()

    def __enter__(self) -> RawCeiling:
        return self

    def __exit__(
        self, t: type[BaseException] | None, v: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def stop_peer(proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    """End a peer process that waits for a line on stdin; killed if it outlives ``timeout_s``."""
    if proc.poll() is not None:
        return
    assert proc.stdin is not None
    try:
        proc.stdin.write(b"\n")
        proc.stdin.flush()
    except BrokenPipeError:
        pass  # already on its way out
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)
