"""The Mooncake Store as ``PoolClient`` sees it: the return codes (measured, see
``app.store.pool``), the ``StoreLike`` protocol and its factory, and the client's config,
counters and results."""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass, field
from typing import Any, Protocol

from app.errors import PoolError

OK = 0
MIN_GLOBAL_SEGMENT = 16 << 20
"""Smallest global segment Mooncake accepts (setup answers -600 below it)."""
NO_AVAILABLE_HANDLE = -200
"""Put: the pool has no room for the object (nothing written): back-pressure."""
INVALID_PARAMS = -600
OBJECT_NOT_FOUND = -704
OBJECT_ALREADY_EXISTS = -705
LEASE_EXPIRED = -707
"""Get: the lease ran out after the bytes were written; a second get succeeds."""
RPC_FAIL = -900
"""Any call: the master did not answer (killed, unreachable)."""


class StoreLike(Protocol):
    """The part of ``MooncakeDistributedStore`` the client uses."""

    def setup(
        self,
        local_hostname: str,
        metadata_server: str,
        global_segment_size: int,
        local_buffer_size: int,
        protocol: str,
        rdma_devices: str,
        master_server_addr: str,
    ) -> int: ...

    def batch_is_exist(self, keys: list[str]) -> list[int]: ...

    def register_buffer(self, buffer_ptr: int, size: int) -> int: ...

    def batch_put_from(
        self, keys: list[str], buffer_ptrs: list[int], sizes: list[int]
    ) -> list[int]: ...

    def batch_get_into(
        self, keys: list[str], buffer_ptrs: list[int], sizes: list[int]
    ) -> list[int]: ...

    # Small objects (the pool's digests, ``app.store.digests``): raw bytes, copied through the
    # client's local buffer, so nothing needs registering.
    def upsert_batch(self, keys: list[str], values: list[bytes]) -> int: ...

    def get_batch(self, keys: list[str]) -> list[bytes]: ...

    def batch_remove(self, keys: list[str], force: bool = False) -> list[int]: ...

    def close(self) -> int: ...


def mooncake_store_factory() -> StoreLike:
    """A new ``MooncakeDistributedStore``; the Mooncake wheel is imported only here."""
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as exc:
        raise PoolError(
            "the KV pool needs Mooncake Store: pip install mooncake-transfer-engine-non-cuda "
            "(CPU) or mooncake-transfer-engine (CUDA); on Debian it also needs "
            f"libibverbs1 librdmacm1 libnuma1 ({exc})"
        ) from exc
    store: StoreLike = MooncakeDistributedStore()
    return store


@dataclass(frozen=True)
class PoolConfig:
    """Where the pool's master is and how this client joins it."""

    master_address: str
    local_hostname: str = "127.0.0.1"
    metadata_server: str = "P2PHANDSHAKE"
    global_segment_size: int = 64 << 20
    local_buffer_size: int = 16 << 20
    protocol: str = "tcp"
    rdma_devices: str = ""
    timeout_s: float = 5.0
    setup_timeout_s: float = 15.0
    close_timeout_s: float = 5.0
    max_workers: int = 2
    max_batch_keys: int = 512
    # How long a call past ``timeout_s`` may keep its buffers before it is reported stuck
    # (logged, counted). Its buffers stay in use all the same: the call can still write them.
    # Mooncake's TCP transport drops a transfer that made no progress for 30 s (measured).
    quarantine_max_s: float = 30.0

    def __post_init__(self) -> None:
        host, sep, port = self.master_address.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise PoolError(f"master_address must be host:port, got {self.master_address!r}")
        if self.protocol not in ("tcp", "rdma"):
            raise PoolError(f"protocol must be tcp or rdma, got {self.protocol!r}")
        if self.local_buffer_size < 0 or not (
            self.global_segment_size == 0 or self.global_segment_size >= MIN_GLOBAL_SEGMENT
        ):
            raise PoolError(
                "global_segment_size must be 0 (contribute nothing) or at least 16 MiB "
                f"(Mooncake's minimum), and local_buffer_size non-negative; got "
                f"{self.global_segment_size} and {self.local_buffer_size}"
            )
        for name in ("timeout_s", "setup_timeout_s", "close_timeout_s", "quarantine_max_s"):
            if getattr(self, name) <= 0:
                raise PoolError(f"{name} must be positive")
        if self.max_workers < 1 or self.max_batch_keys < 1:
            raise PoolError("max_workers and max_batch_keys must be at least 1")


@dataclass(frozen=True)
class PoolCounters:
    """A snapshot of the client's counters (keys unless named bytes / calls)."""

    hits: int = 0
    misses: int = 0
    keys_put: int = 0
    keys_skipped: int = 0
    keys_got: int = 0
    bytes_put: int = 0
    bytes_got: int = 0
    backpressure: int = 0
    failures: int = 0
    timeouts: int = 0
    late_returns: int = 0  # calls that returned after their timeout (their buffers were held)
    late_running: int = 0  # calls past their timeout still running now (a gauge, not a total)


@dataclass(frozen=True)
class PutResult:
    """What a put did, by index into the request's keys.

    After a timeout every key is reported failed, though some may still land in the pool:
    ``late`` is the call still running, which reads the buffers until it is done.
    """

    stored: tuple[int, ...] = ()
    skipped: tuple[int, ...] = ()
    backpressure: tuple[int, ...] = ()
    failed: tuple[int, ...] = ()
    bytes_put: int = 0
    timed_out: bool = False
    late: concurrent.futures.Future[Any] | None = field(default=None, compare=False)

    @property
    def complete(self) -> bool:
        """Every key is in the pool now (stored or already there)."""
        return not self.backpressure and not self.failed


@dataclass(frozen=True)
class GetResult:
    """What a get loaded, by index; ``failed`` blocks must be recomputed by the caller.

    After a timeout the transfer may still land in the buffers later: ``late`` is that call;
    do not reuse the buffers for other data until it is done.
    """

    loaded: tuple[int, ...] = ()
    failed: tuple[int, ...] = ()
    codes: tuple[int, ...] = ()
    bytes_got: int = 0
    timed_out: bool = False
    late: concurrent.futures.Future[Any] | None = field(default=None, compare=False)

    @property
    def ok(self) -> bool:
        """Every requested block was loaded."""
        return not self.failed
