"""A vLLM cache manager publishing through vLLM's own ZMQ publisher on loopback ports."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.proxy.kv_events.engine import CacheEngine, Endpoints, publisher


@pytest.fixture
def ends() -> Endpoints:
    return Endpoints.new()


@pytest.fixture
def engine(ends: Endpoints) -> Iterator[CacheEngine]:
    """24 blocks of 16 tokens, publishing on topic ``kv``."""
    e = CacheEngine(num_blocks=24, pub=publisher(ends))
    yield e
    e.close()
