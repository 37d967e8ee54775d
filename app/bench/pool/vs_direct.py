"""``bench pool-vs-direct``: a conversation's history back to prefill through the KV pool, or
written by decode straight into prefill's blocks, the same bytes over the same transport.

Through the pool the history is copied twice: decode stores it into the pool's memory after
the answer (off the next turn's path: the user reads, the tool runs), and the next turn's
prefill loads it (on the path). A direct transfer copies once, on the path. So on the path the
question is only whether a pool load is slower than a direct write of the same bytes.

Both run here with real Mooncake over loopback TCP, alternating rep by rep so both see the same
noise: the pool is a real master, a process contributing the segment (decode's memory) and this
process as prefill loading ``objects`` blocks of ``object_bytes`` with one ``batch_get_into``;
the direct way is ``raw.RawCeiling``: the same bytes in descriptors of the same size written
into a peer process's registered buffer, the path the sidecar's own writes take. The A/A floor
is each way's odd reps against its even ones.
"""

from __future__ import annotations

import asyncio
import mmap
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from app.bench.core.raw import RawCeiling, stop_peer
from app.errors import BenchError
from app.store.master import start_master, stop_master
from app.store.pool import PoolClient
from app.store.pool_api import PoolConfig

MiB = 1 << 20


@dataclass(frozen=True)
class PoolVsDirectOptions:
    object_bytes: Sequence[int] = (512 << 10, 8 << 20)  # a block of one layer; of 16
    total_bytes: int = 64 * MiB
    reps: int = 10


def _spread(xs: Sequence[float]) -> dict[str, float]:
    return {"min": min(xs), "median": statistics.median(xs), "max": max(xs), "n": len(xs)}


def _halves(xs: Sequence[float]) -> float:
    """Median of the odd reps over that of the even ones: the way's own noise."""
    return statistics.median(xs[1::2]) / statistics.median(xs[::2])


class _Holder:
    def __init__(self, master: str, segment: int) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "app.bench.pool.holder", master, str(segment)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        assert self.proc.stdout is not None
        if self.proc.stdout.readline().strip() != b"ready":
            self.close()
            raise BenchError("the pool's segment holder did not join the pool")

    def close(self) -> None:
        stop_peer(self.proc, 20)


async def _pool_client(master: str, buf: np.ndarray) -> PoolClient:
    # Prefill's side contributes nothing: every object lives in the holder's segment.
    client = PoolClient(PoolConfig(master_address=master, global_segment_size=0, timeout_s=60.0))
    await client.start_async()
    await client.register_async(int(buf.ctypes.data), buf.nbytes)
    return client


async def _measure(opts: PoolVsDirectOptions, master: str) -> list[dict[str, Any]]:
    size = opts.total_bytes
    mm = mmap.mmap(-1, 2 * size)
    buf = np.frombuffer(mm, dtype=np.uint8)
    buf[::4096] = 1  # prefault
    src, dst = buf[:size], buf[size:]
    src[:] = np.arange(size, dtype=np.uint64).astype(np.uint8)
    client = await _pool_client(master, buf)
    raw = RawCeiling(size)
    rows = []
    try:
        for ob in opts.object_bytes:
            n = size // ob
            keys = [f"pvd/{ob}/{i}" for i in range(n)]
            base = int(buf.ctypes.data)
            t0 = time.monotonic()
            put = await client.put_from_async(keys, [base + i * ob for i in range(n)], [ob] * n)
            stored_s = time.monotonic() - t0
            if len(put.stored) != n:
                raise BenchError(f"stored {len(put.stored)} of {n} objects of {ob} bytes")
            lengths = np.full(n, ob, dtype=np.uint64)
            pool_s, direct_s = [], []
            for _ in range(opts.reps):
                dst[:] = 0
                t0 = time.monotonic()
                got = await client.get_into_async(
                    keys, [base + size + i * ob for i in range(n)], [ob] * n
                )
                pool_s.append(time.monotonic() - t0)
                if got.failed or not np.array_equal(src, dst):
                    raise BenchError(f"the pool load of {n} x {ob} bytes did not land whole")
                direct_s.append(raw.write([lengths])[0])
            rows.append(
                {
                    "object_bytes": ob,
                    "objects": n,
                    "bytes": n * ob,
                    "store_s": stored_s,
                    "pool_load_ms": _spread([1000 * s for s in pool_s]),
                    "direct_ms": _spread([1000 * s for s in direct_s]),
                    "pool_gbps": n * ob / statistics.median(pool_s) / 1e9,
                    "direct_gbps": n * ob / statistics.median(direct_s) / 1e9,
                    "pool_over_direct": statistics.median(
                        [p / d for p, d in zip(pool_s, direct_s, strict=True)]
                    ),
                    "aa_pool": _halves(pool_s),
                    "aa_direct": _halves(direct_s),
                }
            )
    finally:
        raw.close()
        await client.close_async()
    return rows


def run(opts: PoolVsDirectOptions) -> dict[str, Any]:
    if opts.reps < 2:
        raise BenchError(f"--reps {opts.reps}: the A/A floor needs at least 2")
    master = start_master()
    holder = None
    try:
        holder = _Holder(master.rpc_address, opts.total_bytes * 2 + 16 * MiB)
        rows = asyncio.run(_measure(opts, master.rpc_address))
    finally:
        if holder is not None:
            holder.close()
        stop_master(master)
    return {"options": asdict(opts), "rows": rows}
