"""Kill the master under a live pool client; print what every call did, as one JSON line.

Run in its own process by ``test_pool.py``: a client whose master died keeps Mooncake threads
retrying it, and its close (one store at a time per process) would hold up every later
client's close in the test process for 7-17 s.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable

import numpy as np

from app.store.master import start_master, stop_master
from app.store.pool import PoolClient
from app.store.pool_api import PoolConfig

BLOCK = 64 * 1024


async def main(log_path: str, timeout_s: float) -> dict[str, object]:
    master = start_master(0, log_path=log_path)
    out: dict[str, object] = {}
    try:
        client = PoolClient(
            PoolConfig(
                master_address=master.rpc_address,
                global_segment_size=16 << 20,
                timeout_s=timeout_s,
                close_timeout_s=1.0,
            )
        )
        await client.start_async()
        src = np.arange(2 * BLOCK, dtype=np.uint64).view(np.uint8)[: 2 * BLOCK].copy()
        ptrs = [src.ctypes.data, src.ctypes.data + BLOCK]
        put = await client.put_from_async(["k0", "k1"], ptrs, [BLOCK] * 2)
        out["put_before"] = list(put.stored)

        os.kill(master.pid, signal.SIGKILL)
        master.wait(timeout=5)

        calls: list[dict[str, object]] = []

        async def timed(name: str, fn: Callable[[], Awaitable[object]]) -> None:
            t0 = time.monotonic()
            result = await fn()
            calls.append({"call": name, "seconds": time.monotonic() - t0, "result": result})

        dst = np.zeros_like(src)
        dptrs = [dst.ctypes.data, dst.ctypes.data + BLOCK]

        # The first call fails at once (-900); later ones block in Mooncake's reconnect.
        async def get() -> list[int]:
            return list((await client.get_into_async(["k0", "k1"], dptrs, [BLOCK] * 2)).failed)

        async def put_more() -> list[int]:
            return list((await client.put_from_async(["k2"], ptrs[:1], [BLOCK])).failed)

        await timed("exists", lambda: client.exists_async(["k0", "k1"]))
        await timed("exists", lambda: client.exists_async(["k0", "k1"]))
        await timed("get_into", get)
        await timed("put_from", put_more)
        await timed("close", client.close_async)
        out["calls"] = calls
        counters = client.counters()
        out["failures"] = counters.failures
        out["timeouts"] = counters.timeouts
    finally:
        stop_master(master, graceful=False)
    return out


if __name__ == "__main__":
    result = asyncio.run(main(sys.argv[1], float(sys.argv[2])))
    print(json.dumps(result), flush=True)
    sys.stderr.flush()
    # The client still closes against the dead master in the background (7-17 s of Mooncake
    # retries), and the interpreter must not shut down under a running Mooncake call: skip
    # the wait -- the test is about the calls above, and the process is done.
    os._exit(0)
