"""Raw-ceiling peer: registers one prefaulted buffer with its own Mooncake engine and waits.

Run as ``python -m app.bench.core.peer SIZE``; prints one JSON line ``{"session", "addr"}`` and
stays up until stdin gives a line or closes. Imports only numpy and Mooncake, so it starts in a
second.
"""

from __future__ import annotations

import json
import mmap
import os
import sys

import numpy as np


def main() -> None:
    """Serve an anonymous shared mapping (shmem, like the engines' /dev/shm KV) as a target."""
    size = int(sys.argv[1])
    os.environ["MC_FORCE_TCP"] = "1"
    from mooncake.engine import TransferEngine

    mm = mmap.mmap(-1, size)
    buf = np.frombuffer(mm, dtype=np.uint8)
    buf[::4096] = 0  # fault every page in now, not during the timed writes
    addr = int(buf.ctypes.data)
    engine = TransferEngine()
    if (rc := engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")) != 0:
        sys.exit(f"initialize returned {rc}")
    if (rc := engine.register_memory(addr, size)) != 0:
        sys.exit(f"register_memory returned {rc}")
    print(json.dumps({"session": f"127.0.0.1:{engine.get_rpc_port()}", "addr": addr}), flush=True)
    sys.stdin.readline()
    # Skip the engine's ~1 s destructor.
    os._exit(0)


if __name__ == "__main__":
    main()
