"""Following engines' KV cache events over ZMQ: one SUB socket per engine feeding its index.

Each ``EngineSubscriber`` reads its engine's PUB socket (wire.py has the frames) and applies
batches in sequence order. When a batch shows that some were missed (its seq jumps, or goes
back: a restarted engine) it asks the engine's replay socket (a ROUTER, vLLM's
``replay_endpoint``) for every batch from the last one applied, within ``replay_timeout_s``:

- the first replayed batch must be the one applied last (same seq, same ``ts``): the engine is
  the one followed, and the batches after it fill the gap;
- otherwise (none, or another ``ts``) the engine restarted (or its buffer moved past us): the
  index forgets it and asks again from seq 0; a fresh engine's buffer starts there (the index
  is whole again), an empty one means it published nothing (it holds nothing); a buffer that
  starts later leaves the index a lower bound until the engine clears or restarts;
- no end marker in time: the batch is applied anyway and the index says what was missed.

The same check runs on start (joining a running engine) and after ``idle_check_s`` without a
batch (a dropped tail or a restart show up with no next batch to reveal them). ZMQ's receive
high-water marks bound what waits in each socket; a replay is applied as it streams in.

It runs too when the SUB socket's connection dropped and came back (ZMQ reconnects by itself;
its socket monitor says so), before the next batch is trusted: the publisher may have restarted
meanwhile, and batches published while the connection was down are lost. A restarted engine's
next batch can carry the very seq that follows the old engine's last one, and would read as
the next batch. Without a replay socket nothing can tell, so the first batch after a
reconnection, unless it is a fresh engine's seq 0, leaves the index a lower bound.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from enum import Enum

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from app.errors import ProtocolError
from app.proxy.kv_events.index import DEFAULT_MAX_BLOCKS, IndexStatus, InstanceIndex, Order
from app.proxy.kv_events.wire import (
    END_SEQ,
    batch_ts,
    decode_batch,
    parse_published,
    parse_replayed,
    replay_request,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SubscriberSettings:
    topic: str = ""  # vLLM's kv_events_config "topic"
    replay_timeout_s: float = 2.0  # one replay, request to end marker
    idle_check_s: float = 5.0  # with no batch for this long, check with the replay socket
    rcvhwm: int = 100_000  # messages ZMQ queues per socket before it drops (vLLM's own hwm)
    # A bigger message drops its connection (ZMQ_MAXMSGSIZE): a batch is some bytes per token
    # it stores, a few hundred KiB for a 100k-token prompt.
    max_message_bytes: int = 64 << 20
    max_blocks: int = DEFAULT_MAX_BLOCKS  # per instance

    def __post_init__(self) -> None:
        if self.replay_timeout_s <= 0 or self.idle_check_s <= 0:
            raise ValueError(
                f"expected replay_timeout_s and idle_check_s > 0; got "
                f"{self.replay_timeout_s} and {self.idle_check_s}"
            )
        if self.rcvhwm <= 0 or self.max_message_bytes <= 0:
            raise ValueError(
                f"expected rcvhwm and max_message_bytes >= 1 (bounded queues); got "
                f"{self.rcvhwm} and {self.max_message_bytes}"
            )


@dataclass(frozen=True)
class SubscriberStatus:
    """One engine's feed, for ``/health``."""

    name: str
    endpoint: str
    replay_endpoint: str | None
    index: IndexStatus
    replays: int  # asked for
    replay_failures: int  # no (valid) answer in time
    last_error: str | None
    last_batch_s_ago: float | None
    reconnects: int = 0  # the connection to the publisher dropped and came back


class _Replay(Enum):
    DONE = "done"  # applied up to the engine's last batch
    MISMATCH = "mismatch"  # not the batch applied last: another engine (restarted)
    FAILED = "failed"  # no valid answer in time


class EngineSubscriber:
    """Follows one engine's events into its ``InstanceIndex`` (``run`` until cancelled)."""

    def __init__(
        self,
        name: str,
        endpoint: str,
        replay_endpoint: str | None,
        index: InstanceIndex,
        settings: SubscriberSettings,
        ctx: zmq.asyncio.Context,
    ) -> None:
        self.name = name
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.index = index
        self.settings = settings
        self._ctx = ctx
        self._topic = settings.topic.encode()
        self.replays = 0
        self.replay_failures = 0
        self.last_error: str | None = None
        self._last_batch_at: float | None = None
        self._replay_failing = False  # log the first failure in a row as a warning only
        self.reconnects = 0
        # The connection dropped and was not checked since (module docstring); with no replay
        # socket to check it with, the next batch is judged alone.
        self._away = False
        self._unchecked = False

    def status(self) -> SubscriberStatus:
        ago = None if self._last_batch_at is None else time.monotonic() - self._last_batch_at
        return SubscriberStatus(
            name=self.name,
            endpoint=self.endpoint,
            replay_endpoint=self.replay_endpoint,
            index=self.index.status(),
            replays=self.replays,
            replay_failures=self.replay_failures,
            last_error=self.last_error,
            last_batch_s_ago=None if ago is None else round(ago, 3),
            reconnects=self.reconnects,
        )

    def _socket(self, kind: int) -> zmq.asyncio.Socket:
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, self.settings.rcvhwm)
        sock.setsockopt(zmq.MAXMSGSIZE, self.settings.max_message_bytes)
        return sock

    async def run(self) -> None:
        sub = self._socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, self._topic)
        monitor = sub.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED)
        sub.connect(self.endpoint)
        poller = zmq.asyncio.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        try:
            await self._resync("start")  # the engine may have published before we came
            idle_ms = int(self.settings.idle_check_s * 1000)
            while True:
                ready = dict(await poller.poll(idle_ms))
                if not ready:
                    await self._resync("idle check")
                    continue
                # Connection events first: a drop must be known before the next batch is read.
                await self._on_connection_events(monitor)
                if sub in ready:
                    await self._on_message(await sub.recv_multipart())
        finally:
            sub.disable_monitor()
            monitor.close(linger=0)
            sub.close(linger=0)

    async def _on_connection_events(self, monitor: zmq.asyncio.Socket) -> None:
        while await monitor.poll(0):
            event = parse_monitor_message(await monitor.recv_multipart())["event"]
            if event == zmq.EVENT_DISCONNECTED and not self._away:
                self._away = True
                log.info("%s: connection to %s dropped", self.name, self.endpoint)
            elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED and self._away:
                # Check now, not at the next batch: a restarted engine may publish nothing.
                await self._back("reconnected")

    async def _back(self, why: str) -> None:
        """The connection came back: what it missed, and whether it is the same publisher."""
        self._away = False
        self.reconnects += 1
        if self.replay_endpoint is None:
            self._unchecked = True
            return
        await self._resync(f"{why} after the connection to {self.endpoint} dropped")

    async def _on_message(self, frames: list[bytes]) -> None:
        try:
            topic, seq, payload = parse_published(frames)
        except ProtocolError as e:
            self._error(f"from {self.endpoint}: {e}")
            return
        if topic != self._topic:
            return  # SUBSCRIBE matches by prefix: a longer topic is another feed's
        self._last_batch_at = time.monotonic()
        if self._away:  # its reconnection was not seen yet: check before trusting the batch
            await self._back("a batch came")
        if self._unchecked:
            self._unchecked = False
            # A fresh engine's seq 0 clears the index anyway; anything else may be either.
            if seq != 0 and self.index.last_seq is not None:
                self.index.lose(
                    f"the connection to {self.endpoint} dropped and there is no replay "
                    "endpoint to check with: a restarted engine cannot be told from the one "
                    "followed"
                )
        await self._take(seq, payload, resync=True)

    async def _take(self, seq: int, payload: bytes, resync: bool) -> None:
        """Apply batch ``seq`` where it falls; with ``resync``, fill a gap before it first."""
        idx = self.index
        try:
            batch = decode_batch(payload)
        except ProtocolError as e:
            self._error(f"{self.name}: batch {seq}: {e}")
            ts = batch_ts(payload)
            # Without a ts a seq already passed counts as seen.
            if idx.order(seq, float("-inf") if ts is None else ts) is not Order.DUPLICATE:
                idx.skip(seq, ts, str(e))
            return
        order = idx.order(seq, batch.ts)
        if order is Order.MISSING and resync and self.replay_endpoint is not None:
            why = f"batch {seq} came after batch {idx.last_seq}"
            log.warning("%s: %s: asking %s to replay", self.name, why, self.replay_endpoint)
            await self._resync(why)
            order = idx.order(seq, batch.ts)
        if order is not Order.DUPLICATE:
            idx.apply(seq, batch)  # still missing: the index clears and says why

    async def _resync(self, why: str) -> None:
        """Catch up from the replay socket (module docstring)."""
        if self.replay_endpoint is None:
            return
        idx = self.index
        self.replays += 1
        if idx.last_seq is not None:
            last = idx.last_seq
            result = await self._replay(last, verify=True, why=why)
            if result is not _Replay.MISMATCH:
                return
            idx.restart(
                f"the replay socket no longer has batch {last} as it was applied: the engine "
                f"restarted, or its replay buffer moved past it"
            )
            log.warning("%s: engine restarted (or replay buffer moved on): rebuilding", self.name)
        await self._replay(0, verify=False, why=why)

    async def _replay(self, start: int, verify: bool, why: str) -> _Replay:
        """Ask for every buffered batch from ``start`` and apply them as they come; with
        ``verify`` the first must be the one applied last."""
        assert self.replay_endpoint is not None
        idx, timeout = self.index, self.settings.replay_timeout_s
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        dealer = self._socket(zmq.DEALER)  # one per replay: a late answer dies with it
        dealer.connect(self.replay_endpoint)
        applied, first = 0, True
        try:
            await dealer.send_multipart(replay_request(start))
            while True:
                left_ms = int((deadline - loop.time()) * 1000)
                if left_ms <= 0 or not await dealer.poll(left_ms):
                    return self._replay_failed(
                        f"no end of replay from {self.replay_endpoint} within {timeout:g}s "
                        f"(asked from seq {start}: {why})"
                    )
                try:
                    _, seq, payload = parse_replayed(await dealer.recv_multipart())
                except ProtocolError as e:
                    return self._replay_failed(f"replay from {self.replay_endpoint}: {e}")
                if seq == END_SEQ:
                    if first and verify:
                        return _Replay.MISMATCH
                    if first:
                        idx.known_empty()  # nothing buffered from seq 0: nothing published
                    self._replay_ok(start, applied, why)
                    return _Replay.DONE
                if first and verify:
                    first = False
                    if seq != start or batch_ts(payload) != idx.last_ts:
                        return _Replay.MISMATCH
                    continue  # the batch applied last: the engine is the one followed
                first = False
                await self._take(seq, payload, resync=False)
                applied += 1
        finally:
            dealer.close(linger=0)

    def _replay_ok(self, start: int, applied: int, why: str) -> None:
        if applied or self._replay_failing:
            log.info(
                "%s: replayed %d batch(es) from seq %d (%s); index %s",
                self.name,
                applied,
                start,
                why,
                "consistent" if self.index.consistent else f"inconsistent: {self.index.reason}",
            )
        self._replay_failing = False

    def _replay_failed(self, message: str) -> _Replay:
        self.replay_failures += 1
        self.last_error = message
        level = logging.DEBUG if self._replay_failing else logging.WARNING
        log.log(level, "%s: %s", self.name, message)
        self._replay_failing = True
        return _Replay.FAILED

    def _error(self, message: str) -> None:
        self.last_error = message
        log.warning("%s", message)
