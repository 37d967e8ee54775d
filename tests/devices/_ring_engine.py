"""The engine end of an event ring in a process of its own (for ``test_ring_two_processes``):
prints its ring spec as JSON, then obeys one command per stdin line, answering each."""

from __future__ import annotations

import sys
import threading

import msgspec

from app.devices.events import EngineRing


class Held:
    """An event that completes on the ``complete`` command."""

    done = threading.Event()

    def record(self) -> None:
        return None

    def synchronize(self) -> None:
        self.done.wait()

    def query(self) -> bool:
        return self.done.is_set()


def main() -> None:
    ring = EngineRing.create(2, slots=2, prefix="kvs-test-2p", timeout_s=30)
    print(msgspec.json.encode(ring.spec).decode(), flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if cmd[0] == "record":
            slot, seq = ring.record(int(cmd[1]), Held() if cmd[2:] == ["held"] else None)
            print(f"{slot} {seq}", flush=True)
        elif cmd[0] == "complete":
            Held.done.set()
            print("ok", flush=True)
        else:
            break
    ring.close()


if __name__ == "__main__":
    main()
