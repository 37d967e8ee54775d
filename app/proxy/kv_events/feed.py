"""Every engine's KV event subscriber under one key scheme, and the router's question to them."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import zmq.asyncio

from app.proxy.kv_events.index import GroupHit, InstanceIndex
from app.proxy.kv_events.keys import DEFAULT_UNIT, KeyScheme
from app.proxy.kv_events.subscriber import EngineSubscriber, SubscriberSettings, SubscriberStatus

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineEvents:
    """Where one engine publishes: its ``kv_events_config`` endpoints as seen from the proxy
    (``tcp://*:5557`` there is ``tcp://<engine host>:5557`` here)."""

    name: str  # the instance, e.g. its URL
    endpoint: str
    replay_endpoint: str | None = None


@dataclass(frozen=True)
class InstanceHits:
    """What one instance holds of a prompt, per group, and whether to believe it whole."""

    name: str
    consistent: bool  # False: the groups' answers are a lower bound
    groups: tuple[GroupHit, ...]


class KvEventFeed:
    """Follows every engine's events (``start``/``close``, or ``async with``)."""

    def __init__(
        self,
        engines: Sequence[EngineEvents],
        settings: SubscriberSettings | None = None,
        scheme: KeyScheme | None = None,
    ) -> None:
        names = [e.name for e in engines]
        if len(set(names)) != len(names):
            raise ValueError(f"expected distinct engine names; got {names}")
        self.settings = settings or SubscriberSettings()
        self.scheme = scheme or KeyScheme.new(DEFAULT_UNIT)
        self._ctx = zmq.asyncio.Context()
        self.subscribers = {
            e.name: EngineSubscriber(
                e.name,
                e.endpoint,
                e.replay_endpoint,
                InstanceIndex(self.scheme, self.settings.max_blocks, e.name),
                self.settings,
                self._ctx,
            )
            for e in engines
        }
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        for sub in self.subscribers.values():
            task = asyncio.create_task(sub.run(), name=f"kv-events {sub.name}")
            task.add_done_callback(functools.partial(self._stopped, sub))
            self._tasks.append(task)

    def _stopped(self, sub: EngineSubscriber, task: asyncio.Task[None]) -> None:
        if task.cancelled():
            return
        e = task.exception()
        if e is not None:
            log.error("%s: KV event subscriber stopped: %r", sub.name, e)
            sub.last_error = f"subscriber stopped: {e!r}"
            sub.index.lose(f"its subscriber stopped: {e!r}")

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks.clear()
        self._ctx.destroy(linger=0)

    async def __aenter__(self) -> KvEventFeed:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def index(self, name: str) -> InstanceIndex:
        return self.subscribers[name].index

    def lookup(
        self, token_ids: Sequence[int], lora_name: str | None = None, cache_salt: str | None = None
    ) -> dict[str, InstanceHits]:
        """Per instance, how many of the prompt's leading whole blocks each group holds."""
        keys = self.scheme.prompt(token_ids, lora_name, cache_salt)
        return {
            name: InstanceHits(name, sub.index.consistent, sub.index.lookup(keys))
            for name, sub in self.subscribers.items()
        }

    def status(self) -> tuple[SubscriberStatus, ...]:
        return tuple(sub.status() for sub in self.subscribers.values())
