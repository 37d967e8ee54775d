"""Shared fixtures of the transfer tests."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import zmq.asyncio


@pytest.fixture
async def ctx() -> AsyncIterator[zmq.asyncio.Context]:
    """An asyncio ZMQ context for the test's servers and clients, destroyed after it."""
    c = zmq.asyncio.Context()
    yield c
    c.destroy(linger=0)
