"""MooncakeEngine against a real Mooncake peer in a second process, over loopback TCP.

The peer (``_mooncake_peer.py``) registers a POSIX shared-memory buffer that this process maps
too, so every write is checked byte for byte here.
"""

from __future__ import annotations

import ast
import asyncio
import json
import select
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing import shared_memory
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from app.errors import ConfigError, TransferError
from app.transfer.lanes.mooncake import EngineConfig, MooncakeEngine, Wait

pytestmark = pytest.mark.timeout(60)

PEER_SIZE = 64 << 20
LOCAL_SIZE = 64 << 20
PEER_SCRIPT = Path(__file__).with_name("_mooncake_peer.py")

U8 = npt.NDArray[np.uint8]


@dataclass
class Peer:
    session: str
    addr: int
    view: U8  # this process's mapping of the peer's registered buffer


def u64(values: Any) -> npt.NDArray[np.uint64]:
    return np.asarray(values, dtype=np.uint64)


@pytest.fixture(scope="module")
def peer_process(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Peer]:
    shm = shared_memory.SharedMemory(create=True, size=PEER_SIZE)
    log = tmp_path_factory.mktemp("mooncake_peer") / "peer.log"
    with log.open("wb") as err:
        proc = subprocess.Popen(
            [sys.executable, str(PEER_SCRIPT), shm.name, str(PEER_SIZE)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
        )
    assert proc.stdin is not None and proc.stdout is not None
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 30)
        line = proc.stdout.readline() if ready else ""
        if not line:
            tail = log.read_text(errors="replace")[-2000:]
            pytest.fail(f"peer did not report its session within 30 s; its log ends:\n{tail}")
        info = json.loads(line)
        # A memmap rather than shm.buf: no exported buffer blocks shm.close() at teardown.
        view = np.memmap(f"/dev/shm/{shm.name}", dtype=np.uint8, mode="r+", shape=(PEER_SIZE,))
        yield Peer(session=info["session"], addr=int(info["addr"]), view=view)
    finally:
        proc.stdin.close()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        shm.close()
        shm.unlink()


@pytest.fixture
def peer(peer_process: Peer) -> Peer:
    peer_process.view[:] = 0
    return peer_process


@pytest.fixture(scope="module")
def local() -> U8:
    return np.random.default_rng(1234).integers(0, 256, LOCAL_SIZE, dtype=np.uint8)


@pytest.fixture(params=["poll", "spin"])
def engine(request: pytest.FixtureRequest, local: U8) -> Iterator[MooncakeEngine]:
    eng = MooncakeEngine(EngineConfig(wait=request.param))
    eng.register(local.ctypes.data, local.nbytes)
    yield eng
    eng.close()


def submits_for(eng: MooncakeEngine, *writes: int) -> int:
    """Submissions for writes of these descriptor counts: one per descriptor when polling, one
    per batch of at most ``max_descriptors_per_submit`` when spinning."""
    if eng.config.wait == "poll":
        return sum(writes)
    step = eng.config.max_descriptors_per_submit
    return sum(-(-n // step) for n in writes)


def write_one(eng: MooncakeEngine, peer: Peer, local: U8, n: int = 4096, off: int = 0) -> None:
    eng.write_sync(peer.session, u64([local.ctypes.data + off]), u64([peer.addr + off]), u64([n]))


def test_many_descriptors_are_chunked_and_land_byte_exact(
    engine: MooncakeEngine, peer: Peer, local: U8
) -> None:
    rng = np.random.default_rng(7)
    n, slot = 3000, 256
    lengths = rng.integers(1, slot, n, dtype=np.uint64)
    src_off = rng.integers(0, LOCAL_SIZE - slot, n, dtype=np.uint64)
    dst_off = rng.permutation(n).astype(np.uint64) * np.uint64(slot)  # scattered, disjoint

    engine.write_sync(peer.session, local.ctypes.data + src_off, peer.addr + dst_off, lengths)

    expected = np.zeros(n * slot, dtype=np.uint8)
    for s, d, ln in zip(src_off.tolist(), dst_off.tolist(), lengths.tolist(), strict=True):
        expected[d : d + ln] = local[s : s + ln]
    assert np.array_equal(peer.view[: n * slot], expected)
    assert not peer.view[n * slot :].any()
    assert engine.submits == submits_for(engine, n)  # spin: 1024 + 1024 + 952
    assert engine.descriptors == n
    assert engine.bytes == int(lengths.sum())
    assert engine.failures == 0 and engine.reopens == 0


def test_write_outside_peer_region_fails_and_only_the_lane_is_replaced(
    engine: MooncakeEngine, peer: Peer, local: U8
) -> None:
    write_one(engine, peer, local)  # opens the lane to the peer
    assert engine._recv is not None
    session, recv_raw = engine.session_id, engine._recv.engine
    old_raw = engine._lanes[peer.session].rec.engine
    k = 40  # on the old engine these rejections would hold the lane for ~10 s
    with pytest.raises(TransferError, match=r"returned -1") as info:
        engine.write_sync(
            peer.session,
            u64([local.ctypes.data] * k),
            peer.addr + PEER_SIZE + 64 * np.arange(k, dtype=np.uint64),
            u64([64] * k),
        )
    msg = str(info.value)
    assert peer.session in msg and f"{k} descriptors" in msg
    assert f"lane to {peer.session} replaced" in msg and f"receive session {session}" in msg
    assert engine.lane_generation(peer.session) == 1
    assert engine.session_id == session and engine.generation == 0
    assert (engine.failures, engine.reopens, engine.descriptors) == (1, 1, 1)
    lane = engine.lane_stats()[peer.session]
    assert (lane.generation, lane.failures, lane.reopens, lane.inflight) == (1, 1, 1, 0)
    # Not observable through the API: the old lane engine must hold none of our memory (-3 = not
    # registered), the new one all of it (-7 = overlaps an existing registration), and the
    # receiving engine is the same object, still holding it.
    assert old_raw.unregister_memory(local.ctypes.data) == -3
    assert engine._lanes[peer.session].rec.engine.register_memory(local.ctypes.data, 8) == -7
    assert engine._recv is not None and engine._recv.engine is recv_raw
    assert recv_raw.register_memory(local.ctypes.data, 8) == -7
    del old_raw, recv_raw

    t0 = time.monotonic()
    write_one(engine, peer, local, n=1 << 20)
    assert time.monotonic() - t0 < 3.0
    assert np.array_equal(peer.view[: 1 << 20], local[: 1 << 20])
    assert engine.failures == 1 and engine.lane_generation(peer.session) == 1


def test_inject_failures_fails_exactly_n_calls_before_the_wire(
    engine: MooncakeEngine, peer: Peer, local: U8
) -> None:
    engine.inject_failures(2)
    for _ in range(2):
        with pytest.raises(TransferError, match="injected failure"):
            write_one(engine, peer, local)
        assert not peer.view[:4096].any()
    write_one(engine, peer, local)
    assert np.array_equal(peer.view[:4096], local[:4096])
    assert (engine.failures, engine.submits, engine.reopens, engine.generation) == (2, 1, 0, 0)

    # From several threads at once, exactly the injected number still fail.
    engine.inject_failures(25)

    def attempt(i: int) -> bool:
        try:
            write_one(engine, peer, local, n=64, off=64 * i)
        except TransferError:
            return False
        return True

    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(attempt, range(60), timeout=30))
    assert results.count(False) == 25
    assert engine.failures == 27 and engine.submits == 1 + 35 and engine.reopens == 0


async def test_async_write_resolves_on_the_loop(
    engine: MooncakeEngine, peer: Peer, local: U8
) -> None:
    chunk = 8 << 20
    ticks = 0
    done = asyncio.Event()

    async def ticker() -> None:
        nonlocal ticks
        while not done.is_set():
            ticks += 1
            await asyncio.sleep(0.001)

    tick_task = asyncio.create_task(ticker())
    writes = [
        engine.write(
            peer.session,
            u64([local.ctypes.data + i * chunk]),
            u64([peer.addr + i * chunk]),
            u64([chunk]),
        )
        for i in range(4)
    ]
    await asyncio.wait_for(asyncio.gather(*writes), timeout=30)
    done.set()
    await asyncio.wait_for(tick_task, timeout=5)
    assert np.array_equal(peer.view[: 4 * chunk], local[: 4 * chunk])
    assert ticks > 0  # the loop kept running while the pool spun
    assert engine.submits == 4 and engine.bytes == 4 * chunk

    engine.inject_failures(1)
    with pytest.raises(TransferError, match="injected"):
        await asyncio.wait_for(
            engine.write(peer.session, u64([local.ctypes.data]), u64([peer.addr]), u64([8])),
            timeout=10,
        )


@pytest.mark.parametrize("wait", ["poll", "spin"])
def test_counters_add_up(peer: Peer, local: U8, wait: Wait) -> None:
    with MooncakeEngine(EngineConfig(max_descriptors_per_submit=500, wait=wait)) as eng:
        eng.register(local.ctypes.data, local.nbytes)
        base_src, base_dst = local.ctypes.data, peer.addr
        sizes, total_bytes = (1500, 10, 501), 0
        off = 0
        for n in sizes:
            idx = np.arange(n, dtype=np.uint64) * np.uint64(32)
            eng.write_sync(peer.session, base_src + off + idx, base_dst + off + idx, u64([32] * n))
            off += 32 * n
            total_bytes += 32 * n
        assert np.array_equal(peer.view[:off], local[:off])
        expected = {
            "submits": submits_for(eng, *sizes),
            "descriptors": sum(sizes),
            "bytes": total_bytes,
            "failures": 0,
            "reopens": 0,
        }
        assert eng.counters() == expected

        eng.inject_failures(1)
        with pytest.raises(TransferError):
            write_one(eng, peer, local)
        with pytest.raises(TransferError):  # outside the peer's buffer
            eng.write_sync(peer.session, u64([base_src]), u64([base_dst + PEER_SIZE]), u64([8]))
        expected.update(submits=submits_for(eng, *sizes, 1), failures=2, reopens=1)
        assert eng.counters() == expected
        got = (eng.submits, eng.descriptors, eng.bytes, eng.failures, eng.reopens)
        assert got == tuple(expected.values())


def test_64mib_as_256kib_descriptors(engine: MooncakeEngine, peer: Peer, local: U8) -> None:
    write_one(engine, peer, local, n=4096)  # handshake outside the timed part
    d = 256 << 10
    n = PEER_SIZE // d
    offs = np.arange(n, dtype=np.uint64) * np.uint64(d)
    t0 = time.perf_counter()
    engine.write_sync(peer.session, local.ctypes.data + offs, peer.addr + offs, u64([d] * n))
    dt = time.perf_counter() - t0
    print(f"\n64 MiB as {n} x 256 KiB over loopback TCP: {PEER_SIZE / dt / 1e9:.2f} GB/s")
    assert np.array_equal(peer.view, local[:PEER_SIZE])
    assert engine.descriptors == 1 + n and engine.submits == submits_for(engine, 1, n)


def test_bad_arguments_fail_before_the_wire(engine: MooncakeEngine, peer: Peer, local: U8) -> None:
    outside = np.zeros(4096, dtype=np.uint8)  # never registered: TCP would send it anyway
    with pytest.raises(TransferError, match="not within any locally registered span"):
        engine.write_sync(
            peer.session,
            u64([local.ctypes.data, outside.ctypes.data]),
            u64([peer.addr, peer.addr + 8192]),
            u64([64, 64]),
        )
    with pytest.raises(TransferError, match="locally registered"):  # runs past the span end
        engine.write_sync(
            peer.session, u64([local.ctypes.data + LOCAL_SIZE - 8]), u64([peer.addr]), u64([16])
        )
    with pytest.raises(TransferError, match="equal sizes, got 2, 1, 1"):
        engine.write_sync(peer.session, u64([1, 2]), u64([3]), u64([4]))
    with pytest.raises(TransferError, match="1-D"):
        engine.write_sync(peer.session, u64([[1]]), u64([[3]]), u64([[4]]))
    with pytest.raises(TransferError, match="negative"):
        engine.write_sync(peer.session, u64([1]), u64([3]), np.array([-4]))
    with pytest.raises(TransferError, match="overlaps"):
        engine.register(local.ctypes.data + 4096, 4096)
    assert not peer.view[:16384].any()
    assert (engine.submits, engine.generation, engine.failures) == (0, 0, 2)
    engine.write_sync(peer.session, u64([]), u64([]), u64([]))  # nothing to do
    assert engine.submits == 0


async def test_close_unregisters_and_refuses_work(peer: Peer, local: U8) -> None:
    eng = MooncakeEngine()
    second = np.ones(1 << 20, dtype=np.uint8)
    eng.register_many([(local.ctypes.data, local.nbytes), (second.ctypes.data, second.nbytes)])
    assert eng.spans == sorted(
        [(local.ctypes.data, local.nbytes), (second.ctypes.data, second.nbytes)]
    )
    write_one(eng, peer, local)  # opens a lane: close() must drop it as well
    assert eng._recv is not None
    raws = [eng._recv.engine, eng._lanes[peer.session].rec.engine]
    eng.close()
    eng.close()  # idempotent
    for raw in raws:
        assert raw.unregister_memory(local.ctypes.data) == -3
        assert raw.unregister_memory(second.ctypes.data) == -3
    del raws, raw
    assert eng.spans == [] and eng.lane_peers() == []
    peer.view[:4096] = 0
    with pytest.raises(TransferError, match="closed"):
        write_one(eng, peer, local)
    with pytest.raises(TransferError, match="closed"):
        await eng.write(peer.session, u64([local.ctypes.data]), u64([peer.addr]), u64([8]))
    with pytest.raises(TransferError, match="closed"):
        eng.register(second.ctypes.data, second.nbytes)
    assert not peer.view[:4096].any()


def test_polled_write_slides_its_window_and_lands_byte_exact(peer: Peer, local: U8) -> None:
    n, size = 300, 4096
    with MooncakeEngine(EngineConfig(max_descriptors_per_submit=7, wait="poll")) as eng:
        eng.register(local.ctypes.data, local.nbytes)
        write_one(eng, peer, local, n=size, off=n * size)  # opens the lane, past the checked part
        lane = eng._lanes[peer.session]
        taken: list[int] = []
        inflight: list[int] = []
        take = lane.take_budget

        def spy(k: int) -> None:
            take(k)
            taken.append(k)
            inflight.append(lane.inflight)

        lane.take_budget = spy  # type: ignore[method-assign]
        src = np.arange(n, dtype=np.uint64)[::-1] * np.uint64(size)  # reversed: no runs
        dst = np.arange(n, dtype=np.uint64) * np.uint64(size)
        eng.write_sync(peer.session, local.ctypes.data + src, peer.addr + dst, u64([size] * n))
        # Topped up as descriptors land, never more than the window in flight.
        assert sum(taken) == n and len(taken) > n // 7 and max(inflight) <= 7
        assert lane.inflight == 0  # every descriptor's budget returned
        for i in range(n):
            s = (n - 1 - i) * size
            assert np.array_equal(peer.view[i * size : (i + 1) * size], local[s : s + size])
        assert (eng.submits, eng.descriptors, eng.bytes) == (n + 1, n + 1, (n + 1) * size)


class CountingEngine:
    """A lane's real engine, counting its ``transfer_check_status`` calls (polls)."""

    def __init__(self, engine: Any) -> None:
        self.engine, self.polls = engine, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def transfer_check_status(self, tid: int) -> int:
        self.polls += 1
        return int(self.engine.transfer_check_status(tid))


def test_polled_write_naps_through_what_is_in_flight(peer: Peer, local: U8) -> None:
    """Once the lane has measured its rate, a write sleeps through most of what it has in
    flight: a few polls beyond one per descriptor (the doubling sleeps alone restarted after
    every landing: ~3 polls a descriptor), and every byte still lands."""
    n, size = 32, 256 << 10
    src = local.ctypes.data + np.arange(n, dtype=np.uint64) * np.uint64(size)
    dst = peer.addr + np.arange(n, dtype=np.uint64)[::-1] * np.uint64(size)
    with MooncakeEngine(EngineConfig(wait="poll")) as eng:
        eng.register(local.ctypes.data, local.nbytes)
        eng.write_sync(peer.session, src, dst, u64([size] * n))  # measures the lane's rate
        lane = eng._lanes[peer.session]
        assert lane.rate is not None and lane.rate > 0
        polls = []
        for _ in range(3):
            peer.view[: n * size] = 0
            counting = CountingEngine(lane.rec.engine)
            lane.rec.engine = counting
            try:
                eng.write_sync(peer.session, src, dst, u64([size] * n))
            finally:
                lane.rec.engine = counting.engine
            polls.append(counting.polls)
            for i in range(n):
                d = (n - 1 - i) * size
                assert np.array_equal(peer.view[d : d + size], local[i * size : (i + 1) * size])
    assert min(polls) <= n + 8, f"polls per 32-descriptor write: {polls}"


def test_a_stalled_write_barely_lowers_the_lane_rate(peer: Peer, local: U8) -> None:
    """A write that reads slow (it waited for a core, or slept past its landings) pulls the
    rate a tenth of the way down, so the next naps do not sleep long past their landings; a
    faster write raises it at once."""
    n, size = 32, 256 << 10
    src = local.ctypes.data + np.arange(n, dtype=np.uint64) * np.uint64(size)
    dst = peer.addr + np.arange(n, dtype=np.uint64) * np.uint64(size)
    with MooncakeEngine(EngineConfig(wait="poll")) as eng:
        eng.register(local.ctypes.data, local.nbytes)
        eng.write_sync(peer.session, src, dst, u64([size] * n))
        lane = eng._lanes[peer.session]
        measured = lane.rate
        assert measured is not None
        lane._measure(n * size, 100 * n * size / measured)  # a write 100x slower
        assert lane.rate is not None and lane.rate >= 0.85 * measured
        lane._measure(n * size, n * size / (2 * measured))  # twice as fast
        assert lane.rate == pytest.approx(2 * measured)


def test_config_rejects_settings_that_poison_or_cannot_work() -> None:
    with pytest.raises(ConfigError, match=r"1\.\.2048"):
        EngineConfig(max_descriptors_per_submit=4096)
    with pytest.raises(ConfigError, match="protocol"):
        EngineConfig(protocol="udp")
    with pytest.raises(ConfigError, match="spin_threads"):
        EngineConfig(spin_threads=0)
    with pytest.raises(ConfigError, match="'poll' or 'spin'"):
        EngineConfig(wait="busy")  # type: ignore[arg-type]


def _imported_modules(path: Path) -> set[str]:
    """Every module a file names in an import, ``from a import b`` counted as ``a`` and ``a.b``."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def test_engine_modules_import_one_way() -> None:
    """mooncake -> lane_pool -> mooncake_lane: no module imports one above it, even for typing."""
    order = [
        "app.transfer.lanes.mooncake",
        "app.transfer.lanes.lane_pool",
        "app.transfer.lanes.mooncake_lane",
    ]
    root = Path(__file__).resolve().parents[2]
    for i, module in enumerate(order):
        bad = _imported_modules(root / f"{module.replace('.', '/')}.py") & set(order[: i + 1])
        assert not bad, f"{module} imports {sorted(bad)}"
