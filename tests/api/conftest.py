"""One live P/D pair for the whole admin API suite: starting one costs tens of seconds here.

Every module uses its own request-id prefix. A module that stops a side leaves it stopped; the
next module that asks for ``cluster`` gets it started again, so module order does not matter.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.api.server import AdminServer
from app.sim.cluster import Cluster, ClusterSpec
from app.sim.commands import Command, SimRequest
from app.transfer.sidecar.process import Sidecar
from tests.conftest import one_rank_settings, wait_for

TOKEN = "api-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
# 512-token prompts in 64-token chunks: 8 chunks x 4 layers of compute per request.
PROMPT = 512
CHUNK = 64

Pairs = list[tuple[SimRequest, SimRequest]]


@contextlib.asynccontextmanager
async def in_process_sidecar(name: str, tmp: Path) -> AsyncIterator[tuple[Sidecar, AdminServer]]:
    """A decode sidecar and its admin API in this process, on ports the OS picks (port 0)."""
    ipc = Path("/dev/shm") / f"kvs-{name}-{tmp.name}"
    ipc.mkdir(exist_ok=True)
    settings = one_rank_settings("decode", name, ipc)
    sc = Sidecar(settings)
    await sc.start()
    admin = AdminServer(sc, settings)
    await admin.start()
    try:
        yield sc, admin
    finally:
        await admin.stop()
        await sc.stop(grace_s=0)
        for f in ipc.glob("*"):
            f.unlink()
        ipc.rmdir()


@pytest.fixture(scope="session")
def _cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    spec = ClusterSpec(
        model="qwen3-next-80b-a3b",
        layers=4,
        prefill_tp=1,
        decode_tp=1,
        max_requests=16,
        max_prompt=PROMPT,
        log_dir=str(tmp_path_factory.mktemp("api-cluster")),
        sidecar_env={
            "KVSIDECAR_ADMIN_TOKEN": TOKEN,
            "KVSIDECAR_SHUTDOWN_GRACE_S": "2",
            # Bounds how long prefill waits for a stopped decode to ack its Done.
            "KVSIDECAR_ACK_TIMEOUT_S": "3",
        },
    )
    with Cluster(spec) as c:
        for side in c.sides.values():
            wait_ready(side.admin_url)
        yield c


@pytest.fixture(scope="module")
def cluster(_cluster: Cluster) -> Cluster:
    """The suite's pair, with any side a previous module stopped started again."""
    for side in _cluster.sides.values():
        if side.sidecar is None or side.sidecar.poll() is not None:
            _cluster.kill_side(side)
            _cluster.start_side(side)
            _cluster.wait_ready(side)
            wait_ready(side.admin_url)
    return _cluster


def wait_ready(url: str, timeout_s: float = 30.0) -> None:
    def ready() -> bool:
        try:
            return httpx.get(f"{url}/readyz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    wait_for(f"{url}/readyz to answer 200", ready, timeout_s)


@pytest.fixture(scope="module")
def prefill(cluster: Cluster) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=cluster.sides["prefill"].admin_url, timeout=10) as c:
        yield c


@pytest.fixture(scope="module")
def decode(cluster: Cluster) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=cluster.sides["decode"].admin_url, timeout=10) as c:
        yield c


@dataclass
class Batch:
    """Requests started on both sides with ``start``; ``finish`` collects the engines' results."""

    cluster: Cluster
    pairs: Pairs

    @property
    def ids(self) -> list[str]:
        return [p.id for p, _ in self.pairs]

    def start(self, compute_ms: float, *, wait_at_decode: bool = True) -> None:
        c = self.cluster
        p, d = c.sides["prefill"], c.sides["decode"]
        d_reqs = [dr for _, dr in self.pairs]
        common: dict[str, Any] = {"chunk": CHUNK, "compute_ms": compute_ms, "timeout_s": 30}
        out = c.call(d, Command(cmd="expect", requests=d_reqs, prefill_tp=p.tp, **common), 30)
        assert not any(r["refused"] for r in out["ranks"]), out
        c.send(p, Command(cmd="prefill", requests=[pr for pr, _ in self.pairs], **common))
        if wait_at_decode:
            c.send(d, Command(cmd="wait", requests=d_reqs, prefill_tp=p.tp, **common))

    def finish(self, *, decode: bool = True) -> dict[str, Any]:
        c = self.cluster
        out = {"prefill": c.recv(c.sides["prefill"], 90)}
        if decode:
            out["decode"] = c.recv(c.sides["decode"], 90)
        c.release(self.pairs)
        return out


@pytest.fixture(scope="module")
def make_batch(cluster: Cluster) -> Callable[[str, int], Batch]:
    def make(prefix: str, n: int) -> Batch:
        return Batch(cluster, cluster.make_requests([PROMPT] * n, prefix))

    return make


def statuses(result: dict[str, Any]) -> dict[str, str]:
    """Request id -> final state as one side's engine saw it."""
    out: dict[str, str] = {}
    for r in result["ranks"]:
        out.update({rid: "DONE" for rid in r["done"]})
        out.update({rid: f["status"] for rid, f in r["failed"].items()})
    return out


def sidecar_log(cluster: Cluster, role: str) -> str:
    return (Path(cluster.log_dir) / f"{role}-sidecar.log").read_text(errors="replace")
