"""What ``bench faults`` observes of the pair while it runs: the sidecars' records, their pool
counters, sends in flight, decode's KV cache, the proxy's transfer records."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np

from app.api.schemas import RequestState
from app.bench.core.cores import descendants
from app.bench.faults.plan import pool_counts
from app.harness.kv_watch import DecodeKV
from app.harness.local_pd import LocalPD

TERMINAL = {RequestState.DONE, RequestState.FAILED, RequestState.ABORTED, RequestState.EXPIRED}


@dataclass
class Watch:
    """Decode sidecar's records seen during a phase (the latest view of each id), polled:
    its history keeps only the last 256 that ended."""

    pd: LocalPD
    recv: dict[str, dict[str, Any]] = field(default_factory=dict)

    async def poll(self, client: httpx.AsyncClient) -> None:
        try:
            r = await client.get(
                f"{self.pd.decode.admin}/v1/requests",
                params={"ended": "true", "side": "recv"},
                timeout=2,
            )
        except httpx.HTTPError:
            return  # down: its last records stay
        if r.status_code == 200:
            self.recv.update((e["id"], e) for e in r.json()["requests"])

    async def run(self, client: httpx.AsyncClient, every_s: float = 1.0) -> None:
        while True:
            await self.poll(client)
            await asyncio.sleep(every_s)

    def inside(self) -> set[int]:
        """Every block a decode record named."""
        return {b for e in self.recv.values() for g in e["groups"] for b in g["block_ids"]}


def _d_pids(pd: LocalPD) -> list[int]:
    # A live process mapping decode's KV: its sidecar, or its engine (core, workers).
    names = ("sidecar-decode", "vllm-decode")
    return descendants(p.pid for n, p in pd.procs.items() if n in names and p.poll() is None)


def decode_blocks(pd: LocalPD) -> list[np.ndarray]:
    return DecodeKV(pd.decode.admin, _d_pids(pd)).blocks()


async def in_flight(client: httpx.AsyncClient, pd: LocalPD, timeout_s: float) -> int:
    """Until prefill's sidecar shows a send part-written (a layer written, or held for
    decode's target) and not ended; how many; 0 at the timeout."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            r = await client.get(
                f"{pd.prefill.admin}/v1/requests", params={"side": "send"}, timeout=2
            )
            live = [
                e
                for e in r.json()["requests"]
                if e["state"] not in TERMINAL
                and (e.get("held_layers") or any(g["layers_sent"] for g in e["groups"]))
            ]
            if live:
                return len(live)
        except httpx.HTTPError:
            pass
        await asyncio.sleep(0.02)
    return 0


async def pool_snapshot(client: httpx.AsyncClient, pd: LocalPD) -> dict[str, dict[str, float]]:
    """Both sidecars' pool counters (``faults.plan.pool_counts``); {} for one that is down."""
    out: dict[str, dict[str, float]] = {}
    for role, inst in (("prefill", pd.prefill), ("decode", pd.decode)):
        try:
            out[role] = pool_counts((await client.get(f"{inst.admin}/metrics")).text)
        except httpx.HTTPError:
            out[role] = {}
    return out


def settle(pd: LocalPD, timeout_s: float) -> dict[str, list[dict[str, Any]]]:
    """Until neither sidecar holds a request that has not ended; what each still holds then."""
    deadline = time.monotonic() + timeout_s
    while True:
        held: dict[str, list[dict[str, Any]]] = {}
        for role, inst in (("prefill", pd.prefill), ("decode", pd.decode)):
            try:
                live = httpx.get(f"{inst.admin}/v1/requests", timeout=5).json()["requests"]
            except httpx.HTTPError:
                live = []
            held[role] = [e for e in live if e["state"] not in TERMINAL]
        if not any(held.values()) or time.monotonic() > deadline:
            return held
        time.sleep(0.25)


def transfers(pd: LocalPD) -> dict[str, dict[str, Any]]:
    rows = httpx.get(f"{pd.proxy}/v1/transfers", timeout=10).json()["transfers"]
    return {t["transfer_id"]: t for t in rows}
