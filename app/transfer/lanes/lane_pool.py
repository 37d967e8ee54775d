"""The local engines of a ``MooncakeEngine``: how they are configured and started
(``EngineConfig``), and its lanes, one ``TransferEngine`` per peer written to, opened on the first
write, replaced after a failed one, evicted when idle and over the bound, closed when the peer
goes (the why is in ``app.transfer.lanes.mooncake``'s docstring; a lane itself is in
``mooncake_lane``).

``LanePool`` is the base of ``MooncakeEngine``: it builds the state and locks both use, and is
never used alone. Imports go one way, ``mooncake`` -> ``lane_pool`` -> ``mooncake_lane``.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Literal

from app.errors import ConfigError, TransferError
from app.transfer.lanes.mooncake_lane import (
    DRAIN_TIMEOUT_S,
    LANE_QUEUE_LIMIT,
    OK,
    Counters,
    Lane,
    LaneStats,
    Registered,
)

__all__ = ["EngineConfig", "LanePool", "Wait"]

Wait = Literal["poll", "spin"]

# Lanes open at once. Peers are named by remote messages, so without a bound a stream of fresh
# names (an attacker's or a churning fleet's) would open an engine each: 3 threads, 6 fds, an RPC
# port and a registration of every span (under RDMA, memory regions the NIC tracks). 64 is well
# above the decode peers one prefill sidecar writes to at once, and costs ~200 threads at most.
_MAX_LANES = 64


@dataclass(frozen=True)
class EngineConfig:
    """How to start the local engines (the receiving one and each lane's) and how to cut writes
    into submits."""

    host: str = "127.0.0.1"
    protocol: str = "tcp"  # "tcp" or "rdma"
    device_name: str = ""
    # Per call: descriptors in flight (poll) or in one batch (spin). DESIGN §6: 4096 poisoned
    # the session, 2048 passed.
    max_descriptors_per_submit: int = 1024
    spin_threads: int = 2  # bounded pool that runs write() calls
    force_tcp: bool = True  # sets MC_FORCE_TCP=1 before initialize when protocol == "tcp"
    wait: Wait = "poll"

    def __post_init__(self) -> None:
        if self.protocol not in ("tcp", "rdma"):
            raise ConfigError(
                f"EngineConfig.protocol must be 'tcp' or 'rdma', got {self.protocol!r}"
            )
        if not 1 <= self.max_descriptors_per_submit <= LANE_QUEUE_LIMIT:
            raise ConfigError(
                f"EngineConfig.max_descriptors_per_submit must be in 1..{LANE_QUEUE_LIMIT} "
                f"(larger batches poison the session), got {self.max_descriptors_per_submit}"
            )
        if self.spin_threads < 1:
            raise ConfigError(f"EngineConfig.spin_threads must be >= 1, got {self.spin_threads}")
        if self.wait not in ("poll", "spin"):
            raise ConfigError(f"EngineConfig.wait must be 'poll' or 'spin', got {self.wait!r}")


def _import_engine_class() -> Any:
    try:
        from mooncake.engine import TransferEngine
    except (ImportError, OSError) as exc:
        raise TransferError(
            "mooncake.engine could not be imported "
            f"({type(exc).__name__}: {exc}); install the 'mooncake' extra "
            "(mooncake-transfer-engine-non-cuda) and Debian's libibverbs1 librdmacm1 libnuma1"
        ) from exc
    return TransferEngine


class LanePool:
    """Starting local engines, and opening, replacing, evicting and closing the per-peer lanes.

    Locks, always taken in this order: a lane's ``admin``, ``_admin_lock`` (the spans and which
    engines they are registered on), ``_guard`` (the lane map, ``_closed`` and whatever the
    subclass publishes under it), a lane's ``cond``.
    """

    def __init__(self, config: EngineConfig) -> None:
        self._config = config
        self._engine_cls = _import_engine_class()
        if config.protocol == "tcp" and config.force_tcp:
            # The engine picks RDMA whenever it finds an HCA unless told otherwise.
            os.environ["MC_FORCE_TCP"] = "1"
        self._admin_lock = threading.Lock()
        self._guard = threading.Lock()
        self._counters = Counters()
        self._spans: dict[int, int] = {}  # every engine started registers all of these
        self._lanes: OrderedDict[str, Lane] = OrderedDict()  # least recently used first
        self._closed = False

    def lane_generation(self, peer: str) -> int:
        """How many times the open lane to ``peer`` has been replaced since it was opened."""
        with self._guard:
            lane = self._lanes.get(peer)
        if lane is None:
            raise TransferError(f"no lane to {peer} is open; open lanes: {self.lane_peers()}")
        with lane.cond:
            return lane.generation

    def lane_peers(self) -> list[str]:
        """Peers with an open lane, least recently used first."""
        with self._guard:
            return list(self._lanes)

    def lane_stats(self) -> dict[str, LaneStats]:
        """Every open lane's generation and counters, least recently used first."""
        with self._guard:
            lanes = list(self._lanes.values())
        return {lane.peer: lane.stats() for lane in lanes}

    # ------------------------------------------------------------- engines and lanes

    def _start_engine(self) -> tuple[Any, str]:
        cfg = self._config
        engine = self._engine_cls()
        rc = engine.initialize(cfg.host, "P2PHANDSHAKE", cfg.protocol, cfg.device_name)
        if rc != OK:
            raise TransferError(
                f"TransferEngine.initialize({cfg.host!r}, 'P2PHANDSHAKE', {cfg.protocol!r}, "
                f"{cfg.device_name!r}) returned {rc}, expected 0"
            )
        return engine, f"{cfg.host}:{engine.get_rpc_port()}"

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError("MooncakeEngine is closed")

    def _pin_open_lane(self, peer: str) -> Lane | None:
        """Under ``_guard``: the open lane to ``peer``, pinned and most recently used."""
        self._check_open()
        lane = self._lanes.get(peer)
        if lane is not None:
            self._lanes.move_to_end(peer)
            lane.pin()
        return lane

    def _acquire_lane(self, peer: str) -> Lane:
        """The lane to ``peer``, opened if need be, pinned against eviction until unpinned."""
        with self._guard:
            lane = self._pin_open_lane(peer)
            if lane is not None:
                return lane
        evicted: Lane | None = None
        try:
            with self._admin_lock:
                with self._guard:
                    # Checked again: another writer may have opened it, or close() begun.
                    lane = self._pin_open_lane(peer)
                    if lane is not None:
                        return lane
                    if len(self._lanes) >= _MAX_LANES:
                        evicted = self._evict_idle(peer)
                rec = Registered(*self._start_engine())
                try:
                    rec.register(sorted(self._spans.items()))
                except BaseException:
                    with contextlib.suppress(TransferError):
                        rec.discard()
                    raise
                cfg = self._config
                lane = Lane(
                    peer,
                    rec,
                    self._counters,
                    window=cfg.max_descriptors_per_submit,
                    poll=cfg.wait == "poll",
                )
                lane.pin()
                with self._guard:
                    self._lanes[peer] = lane
                return lane
        finally:
            if evicted is not None:  # out of the locks: its destructor holds the GIL ~1 s
                evicted.rec.discard()

    def _evict_idle(self, peer: str) -> Lane:
        """Close the least recently used lane nothing is using; caller holds ``_admin_lock``
        and ``_guard``."""
        for lane in self._lanes.values():
            with lane.cond:
                if lane.users == 0 and not lane.reopening:
                    lane.closed = True
                    break
        else:
            raise TransferError(
                f"all {_MAX_LANES} lanes are in use; write to {peer} not sent (expected a lane "
                "with no write in progress to close)"
            )
        del self._lanes[lane.peer]
        return lane

    def _reopen_lane(self, lane: Lane, failed_generation: int) -> str:
        """Replace the lane's engine unless another writer already did or the lane was closed;
        says which happened."""
        with lane.admin:
            with lane.cond:
                if lane.closed:
                    return f"lane to {lane.peer} was closed meanwhile"
                if lane.generation != failed_generation:
                    return (
                        f"lane to {lane.peer} already replaced by another write "
                        f"(lane generation {lane.generation})"
                    )
                lane.reopening = True
            try:
                new = Registered(*self._start_engine())
                try:
                    with self._admin_lock:
                        self._check_open()
                        # Registered before draining so the swap itself is quick; as pending,
                        # registrations made while draining reach it too.
                        new.register(sorted(self._spans.items()))
                        lane.pending = new
                    with lane.cond:
                        if not lane.cond.wait_for(
                            lambda: lane.writers == 0, timeout=DRAIN_TIMEOUT_S
                        ):
                            raise TransferError(
                                f"{lane.writers} write(s) to {lane.peer} still running on the "
                                f"old engine after {DRAIN_TIMEOUT_S:.0f} s; old engine kept"
                            )
                    with self._admin_lock, lane.cond:
                        old, lane.rec, lane.pending = lane.rec, new, None
                        lane.generation += 1
                        generation = lane.generation
                except BaseException:
                    with self._admin_lock:
                        lane.pending = None
                    # Keep the original error; the spans may not all be registered there.
                    with contextlib.suppress(TransferError):
                        new.discard()
                    raise
            finally:
                with lane.cond:
                    lane.reopening = False
                    lane.cond.notify_all()
        lane.count(reopens=1)
        old.discard()
        return f"lane to {lane.peer} replaced, now {new.session} (lane generation {generation})"

    def close_lane(self, peer: str) -> bool:
        """Close the lane to a peer that is gone; False if none was open.

        Waits for a reopen of that lane and for the writes on it (a write to a stopped peer
        fails after 30 s); writes still waiting to start fail. Blocking: call it off the loop.
        """
        with self._guard:
            lane = self._lanes.get(peer)
        return lane is not None and self._close_lane(lane)

    def _close_lane(self, lane: Lane) -> bool:
        with lane.admin:
            with self._admin_lock:
                with self._guard:
                    if self._lanes.get(lane.peer) is lane:
                        del self._lanes[lane.peer]
                with lane.cond:
                    if lane.closed:
                        return False
                    lane.closed = True
                    lane.cond.notify_all()
            with lane.cond:
                if not lane.cond.wait_for(lambda: lane.writers == 0, timeout=DRAIN_TIMEOUT_S):
                    # Writers hold the engine; it goes, registrations and all, after the last.
                    raise TransferError(
                        f"{lane.writers} write(s) to {lane.peer} still running "
                        f"{DRAIN_TIMEOUT_S:.0f} s after its lane was closed; expected none"
                    )
            lane.rec.discard()
        return True
