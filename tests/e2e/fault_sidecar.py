"""A sidecar process with faults hooked in, for the e2e tests: ``python -m
tests.e2e.fault_sidecar --fail-writes N`` serves like ``kv-sidecar serve`` (settings from the
environment) but its Mooncake engine fails its first N write calls; ``--flip-writes`` makes
every write carry a flipped bit every 256 bytes of each run (flipped in prefill's memory for the
write only, then restored: a fault on the wire, which decode's digest check must catch);
``--old-decode`` answers ``LayerDigests`` with ``Error``, as a release that predates them does."""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import sys
from typing import Any

import numpy as np

from app.config import load_settings
from app.service import serve
from app.transfer.lanes.mooncake import MooncakeEngine
from app.transfer.requests.receiving import RecvSide
from app.transfer.wire.protocol import Error, LayerDigests


def command(
    *, fail_writes: int = 0, flip_writes: bool = False, old_decode: bool = False
) -> list[str]:
    """The argv that starts this launcher (for ``ClusterSpec.sidecar_cmd``)."""
    flip = ["--flip-writes"] if flip_writes else []
    old = ["--old-decode"] if old_decode else []
    return [sys.executable, "-m", __name__, "--fail-writes", str(fail_writes), *flip, *old]


async def _unknown(self: RecvSide, msg: LayerDigests) -> Error:
    # What a decode without LayerDigests answers: its decoder knows no such tag.
    return Error(reason="malformed frame: expected a msgpack map whose 'type' names a message")


def flip_in_flight(engine: MooncakeEngine) -> None:
    """Every write of ``engine`` lands with bit 0 of every 256th byte of each run flipped."""
    write = engine.write_sync

    def flipped(peer: str, src: np.ndarray, dst: np.ndarray, length: np.ndarray) -> Any:
        # Runs may span several requests' blocks (coalesced): a flip every 256 bytes reaches each.
        starts = [
            np.arange(a, a + n, 256) for a, n in zip(src.tolist(), length.tolist(), strict=True)
        ]
        addrs = np.unique(np.concatenate(starts)) if starts else np.zeros(0, np.int64)
        cells = [ctypes.c_uint8.from_address(int(a)) for a in addrs]
        for c in cells:
            c.value ^= 1
        try:
            return write(peer, src, dst, length)
        finally:
            for c in cells:
                c.value ^= 1

    engine.write_sync = flipped  # type: ignore[method-assign]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fail-writes", type=int, default=0)
    parser.add_argument("--flip-writes", action="store_true")
    parser.add_argument("--old-decode", action="store_true")
    args = parser.parse_args()
    if args.old_decode:
        RecvSide.layer_digests = _unknown  # type: ignore[assignment,method-assign]

    def hook(engine: MooncakeEngine) -> None:
        engine.inject_failures(args.fail_writes)
        if args.flip_writes:
            flip_in_flight(engine)

    return asyncio.run(serve(load_settings({}, None), engine_hook=hook))


if __name__ == "__main__":
    raise SystemExit(main())
