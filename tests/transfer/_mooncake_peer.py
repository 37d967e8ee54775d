"""Test peer: registers a shared-memory buffer with its own Mooncake engine and waits.

Usage: python _mooncake_peer.py SHM_NAME SIZE. Prints one JSON line with the session id and the
buffer address, then stays up until stdin gives a line or closes.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np


def main() -> None:
    """Serve the parent's shared-memory buffer as a Mooncake write target."""
    name, size = sys.argv[1], int(sys.argv[2])
    os.environ["MC_FORCE_TCP"] = "1"
    from mooncake.engine import TransferEngine

    # Mapped through /dev/shm so the parent keeps sole ownership: attaching via
    # multiprocessing.shared_memory would let this process's resource tracker unlink it.
    buf = np.memmap(f"/dev/shm/{name}", dtype=np.uint8, mode="r+", shape=(size,))
    addr = int(buf.ctypes.data)
    engine = TransferEngine()
    rc = engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    if rc != 0:
        sys.exit(f"initialize returned {rc}")
    rc = engine.register_memory(addr, size)
    if rc != 0:
        sys.exit(f"register_memory returned {rc}")
    print(json.dumps({"session": f"127.0.0.1:{engine.get_rpc_port()}", "addr": addr}), flush=True)
    sys.stdin.readline()
    # Skip the engine's ~1 s destructor; the parent unlinks the memory.
    os._exit(0)


if __name__ == "__main__":
    main()
