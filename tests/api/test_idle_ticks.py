"""An idle admin API does not wake the sidecar's loop ten times a second (uvicorn's tick),
yet keeps its Date header current and stops at once."""

from __future__ import annotations

import asyncio
import time
from email.utils import parsedate_to_datetime
from pathlib import Path

import httpx
import pytest
import uvicorn

from tests.api.conftest import in_process_sidecar

pytestmark = pytest.mark.timeout(60)


async def test_idle_admin_api_ticks_once_a_second(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """uvicorn's own loop ticked every 0.1 s: 30 ticks in these 3 s, here at most 4; the Date
    header still moves with the clock, and ``stop`` does not wait for a tick."""
    ticks = 0
    on_tick = uvicorn.Server.on_tick

    async def counted(self: uvicorn.Server, counter: int) -> bool:
        nonlocal ticks
        ticks += 1
        return await on_tick(self, counter)

    monkeypatch.setattr(uvicorn.Server, "on_tick", counted)
    async with in_process_sidecar("idle-ticks", tmp_path) as (_, admin):
        async with httpx.AsyncClient(base_url=admin.url) as client:
            first = parsedate_to_datetime((await client.get("/livez")).headers["date"])
            before = ticks
            await asyncio.sleep(3.0)
            idle_ticks = ticks - before
            last = parsedate_to_datetime((await client.get("/livez")).headers["date"])
        t0 = time.monotonic()
        await admin.stop()
        stopped_s = time.monotonic() - t0
    assert idle_ticks <= 4, f"{idle_ticks} ticks of the admin server in 3 s idle"
    assert (last - first).total_seconds() >= 2, (first, last)
    assert stopped_s < 0.5, f"stop took {stopped_s:.2f} s"
