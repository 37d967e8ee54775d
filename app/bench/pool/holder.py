"""The pool's memory on decode's side for ``bench pool-vs-direct``: a Mooncake Store client that
contributes a segment and waits.

Run as ``python -m app.bench.pool.holder MASTER SEGMENT_BYTES``; prints ``ready`` once joined
and stays until stdin gives a line or closes.
"""

from __future__ import annotations

import asyncio
import os
import sys

from app.store.pool import PoolClient
from app.store.pool_api import PoolConfig


async def _hold(master: str, segment: int) -> None:
    client = PoolClient(PoolConfig(master_address=master, global_segment_size=segment))
    await client.start_async()
    print("ready", flush=True)
    await asyncio.to_thread(sys.stdin.readline)


def main() -> None:
    asyncio.run(_hold(sys.argv[1], int(sys.argv[2])))
    # The store's teardown holds the GIL for seconds (pool.py): nothing is left to save.
    os._exit(0)


if __name__ == "__main__":
    main()
