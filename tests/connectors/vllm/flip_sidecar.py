"""``kv-sidecar serve`` with flipped bits in what it writes, for real engines: ``python -m
tests.connectors.vllm.flip_sidecar --flip wire|pool --role prefill ...`` takes ``serve``'s
flags as LocalPD passes them (``flipping`` swaps the command in).

``wire``: every push write lands with a bit flipped every 256 bytes of each run; ``pool``: so
does every object the KV pool stores. Flipped in engine memory for the write only, then
restored: what lands differs from what the engine computed, while the sender's digest (taken
after its write) is of the right bytes. The bit is an exponent bit of a float32 or bfloat16
value (0x40 of the 4th byte), so KV used unchecked changes answers, not only digests (the e2e
fault sidecar's bit 0 of the 1st byte, float32's lowest mantissa bit, left every tiny model's
greedy answers as they were).
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from app.config import load_settings
from app.service import serve
from app.store.pool import PoolClient
from app.store.pool_api import StoreLike
from app.transfer.lanes.mooncake import MooncakeEngine

# serve's flags LocalPD passes (app.harness.engines.sidecar_command), as settings names.
FLAGS = (
    *("role", "engine-id", "ranks", "tp-size", "control-host", "control-port", "engine-ipc"),
    *("admin-port", "port-file"),
)


def flipping(command: Callable[..., list[str]], roles: str, flip: str) -> Callable[..., list[str]]:
    """``command`` (sidecar_command), with this launcher in place of ``serve`` for the
    sidecars of ``roles`` (e.g. "prefill", "prefill,decode")."""

    def swapped(inst: Any, admin_port: int) -> list[str]:
        argv = command(inst, admin_port)
        if inst.role not in roles.split(","):
            return argv
        serve_at = argv.index("serve")
        return [sys.executable, "-m", __name__, "--flip", flip, *argv[serve_at + 1 :]]

    return swapped


@contextmanager
def flipped(ptrs: list[int], sizes: list[int]) -> Iterator[None]:
    """Bit 6 of the 4th byte of every 256 of each span flipped, until the block ends (each
    byte once: coalesced runs may overlap)."""
    addrs = {a + 3 for p, n in zip(ptrs, sizes, strict=True) for a in range(p, p + n - 3, 256)}
    cells = [ctypes.c_uint8.from_address(a) for a in sorted(addrs)]
    for c in cells:
        c.value ^= 0x40
    try:
        yield
    finally:
        for c in cells:
            c.value ^= 0x40


def flip_wire(engine: MooncakeEngine) -> None:
    """Every write of ``engine`` lands flipped (``flipped`` over its source runs)."""
    write = engine.write_sync

    def flipped_write(peer: str, src: np.ndarray, dst: np.ndarray, length: np.ndarray) -> Any:
        with flipped(src.tolist(), length.tolist()):
            return write(peer, src, dst, length)

    engine.write_sync = flipped_write  # type: ignore[method-assign]


class FlippedPuts:
    """A Mooncake store whose ``batch_put_from`` stores flipped bytes; the rest as it is."""

    def __init__(self, store: StoreLike) -> None:
        self._store = store

    def batch_put_from(self, keys: list[str], ptrs: list[int], sizes: list[int]) -> list[int]:
        with flipped(ptrs, sizes):
            return self._store.batch_put_from(keys, ptrs, sizes)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


def flip_pool_puts() -> None:
    """Every PoolClient of this process stores through ``FlippedPuts``."""
    finish = PoolClient._finish_start

    def finish_flipped(self: PoolClient, executor: Any, store: StoreLike) -> None:
        finish(self, executor, FlippedPuts(store))

    PoolClient._finish_start = finish_flipped  # type: ignore[method-assign]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--flip", choices=("wire", "pool"), default="wire")
    for flag in FLAGS:
        parser.add_argument(f"--{flag}")
    args = vars(parser.parse_args())
    flip = args.pop("flip")
    flags = {k: v for k, v in args.items() if v is not None}
    if flip == "pool":
        flip_pool_puts()
    hook = flip_wire if flip == "wire" else None
    return asyncio.run(serve(load_settings(flags, None), engine_hook=hook))


if __name__ == "__main__":
    raise SystemExit(main())
