"""Per-peer lanes of MooncakeEngine against real Mooncake peers in other processes.

Each peer (``_mooncake_peer.py``) registers a POSIX shared-memory buffer that this process maps
too, so every write is checked byte for byte here. Peers die by SIGKILL and hang by SIGSTOP.
"""

from __future__ import annotations

import contextlib
import json
import select
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from multiprocessing import shared_memory
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from app.errors import TransferError
from app.transfer.lanes import lane_pool
from app.transfer.lanes.mooncake import EngineConfig, MooncakeEngine

pytestmark = pytest.mark.timeout(90)

PEER_SIZE = 8 << 20
LOCAL_SIZE = 16 << 20
CHUNK = 64 << 10
PEER_SCRIPT = Path(__file__).with_name("_mooncake_peer.py")
# What a live-peer write may take while another peer's lane is reopened: the old engine's
# destructor holds the GIL for up to ~1 s (module docstring), which lanes cannot avoid.
LIVE_WRITE_BOUND_S = 3.0

U8 = npt.NDArray[np.uint8]


@dataclass
class PeerProc:
    proc: subprocess.Popen[str]
    session: str
    addr: int
    view: U8  # this process's mapping of the peer's registered buffer


def stop(proc: subprocess.Popen[str], timeout_s: float = 10.0) -> None:
    """SIGSTOP ``proc`` and wait until the kernel shows it stopped: on a loaded machine the
    signal takes effect only once the process is scheduled, and a write sent before that could
    still be answered (a CI run saw two)."""
    proc.send_signal(signal.SIGSTOP)
    deadline = time.monotonic() + timeout_s
    # /proc/PID/stat: "pid (comm) state ...", the state after the last ")".
    while Path(f"/proc/{proc.pid}/stat").read_text().rpartition(")")[2].split()[0] != "T":
        assert time.monotonic() < deadline, f"peer {proc.pid} did not stop"
        time.sleep(0.01)


def u64(values: Any) -> npt.NDArray[np.uint64]:
    return np.asarray(values, dtype=np.uint64)


@contextlib.contextmanager
def spawn_peers(n: int, logs: Path) -> Iterator[list[PeerProc]]:
    """``n`` receiving peers, started together; stopped or killed ones are reaped at the end."""
    shms = [shared_memory.SharedMemory(create=True, size=PEER_SIZE) for _ in range(n)]
    procs: list[subprocess.Popen[str]] = []
    try:
        for i, shm in enumerate(shms):
            with (logs / f"peer{i}.log").open("wb") as err:
                procs.append(
                    subprocess.Popen(
                        [sys.executable, str(PEER_SCRIPT), shm.name, str(PEER_SIZE)],
                        stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE,
                        stderr=err,
                        text=True,
                    )
                )
        peers = []
        for i, (proc, shm) in enumerate(zip(procs, shms, strict=True)):
            assert proc.stdout is not None
            ready, _, _ = select.select([proc.stdout], [], [], 30)
            line = proc.stdout.readline() if ready else ""
            if not line:
                tail = (logs / f"peer{i}.log").read_text(errors="replace")[-2000:]
                pytest.fail(f"peer {i} did not report its session within 30 s; log ends:\n{tail}")
            info = json.loads(line)
            view = np.memmap(f"/dev/shm/{shm.name}", dtype=np.uint8, mode="r+", shape=(PEER_SIZE,))
            peers.append(PeerProc(proc, info["session"], int(info["addr"]), view))
        yield peers
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                assert proc.stdin is not None
                proc.stdin.close()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=10)
        for shm in shms:
            shm.close()
            shm.unlink()


@pytest.fixture(scope="module")
def local() -> U8:
    return np.random.default_rng(99).integers(0, 256, LOCAL_SIZE, dtype=np.uint8)


@pytest.fixture
def engine(local: U8) -> Iterator[MooncakeEngine]:
    with MooncakeEngine(EngineConfig()) as eng:
        eng.register(local.ctypes.data, local.nbytes)
        yield eng


def write_checked(eng: MooncakeEngine, peer: PeerProc, local: U8, i: int) -> None:
    """Write the ``i``-th chunk to ``peer`` and check its bytes landed."""
    src = (i * 7919 * 64) % (LOCAL_SIZE - CHUNK)
    dst = (i * CHUNK) % PEER_SIZE
    eng.write_sync(
        peer.session, u64([local.ctypes.data + src]), u64([peer.addr + dst]), u64([CHUNK])
    )
    if not np.array_equal(peer.view[dst : dst + CHUNK], local[src : src + CHUNK]):
        raise AssertionError(f"write {i} to {peer.session} landed wrong bytes at +{dst}")


@dataclass
class Pump:
    """Writes to one peer from a thread of its own until stopped or until a write fails."""

    eng: MooncakeEngine
    peer: PeerProc
    local: U8
    spans: list[tuple[float, float]] = field(default_factory=list)  # (start, end) per write
    error: BaseException | None = None
    failed: tuple[float, float] = (0.0, 0.0)  # (start, end) of the write that raised
    stop: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None

    def start(self) -> Pump:
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        return self

    def _run(self) -> None:
        i = 0
        while not self.stop.is_set():
            t0 = time.monotonic()
            try:
                write_checked(self.eng, self.peer, self.local, i)
            except BaseException as exc:
                self.error, self.failed = exc, (t0, time.monotonic())
                return
            self.spans.append((t0, time.monotonic()))
            i += 1

    def wait_for(self, writes: int, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while len(self.spans) < writes and self.error is None:
            assert time.monotonic() < deadline, f"{len(self.spans)} of {writes} writes in time"
            time.sleep(0.005)

    def join(self) -> None:
        self.stop.set()
        assert self.thread is not None
        self.thread.join(timeout=60)
        assert not self.thread.is_alive()

    def overlapping(self, t0: float, t1: float) -> list[float]:
        """Durations of the writes that were running at some point in ``[t0, t1]``."""
        return [b - a for a, b in self.spans if b >= t0 and a <= t1]


def test_killed_peer_reopens_only_its_lane(
    engine: MooncakeEngine, local: U8, tmp_path: Path
) -> None:
    with spawn_peers(2, tmp_path) as (live, doomed):
        session = engine.session_id
        pumps = [Pump(engine, live, local).start(), Pump(engine, doomed, local).start()]
        for p in pumps:
            p.wait_for(20)
        live_raw = engine._lanes[live.session].rec.engine
        doomed.proc.kill()
        assert pumps[1].thread is not None
        pumps[1].thread.join(timeout=30)
        before = len(pumps[0].spans)
        pumps[0].wait_for(before + 50)  # live writes go on after the reopen
        pumps[0].join()

        assert pumps[0].error is None, pumps[0].error
        err = pumps[1].error
        assert isinstance(err, TransferError), err
        assert f"lane to {doomed.session} replaced" in str(err)
        assert f"receive session {session} unchanged" in str(err)
        assert engine.lane_generation(doomed.session) == 1
        assert engine.lane_generation(live.session) == 0
        assert engine._lanes[live.session].rec.engine is live_raw  # same engine, same connection
        del live_raw
        assert engine.session_id == session and engine.generation == 0
        stats = engine.lane_stats()
        assert (stats[live.session].failures, stats[live.session].reopens) == (0, 0)
        assert (stats[doomed.session].failures, stats[doomed.session].reopens) == (1, 1)
        c = engine.counters()
        assert (c["failures"], c["reopens"]) == (1, 1)
        assert c["descriptors"] == len(pumps[0].spans) + len(pumps[1].spans)

        # The failed write's span covers the failure, the reopen and the old engine's discard.
        t0, t1 = pumps[1].failed
        during = pumps[0].overlapping(t0, t1)
        print(
            f"\nkilled peer: its failed write and lane reopen took {t1 - t0:.3f} s; "
            f"{len(during)} live write(s) overlapped, longest {max(during, default=0) * 1e3:.1f} ms"
        )
        assert max(during, default=0) < LIVE_WRITE_BOUND_S


def test_live_writes_do_not_wait_for_a_stuck_peer_while_a_dead_ones_lane_reopens(
    engine: MooncakeEngine, local: U8, tmp_path: Path
) -> None:
    """A single engine had to drain every writer before replacing itself: a write hung on a
    stopped peer (30 s) then held up the reopen for a killed one and every write behind it."""
    with spawn_peers(3, tmp_path) as (live, doomed, stuck):
        for p in (doomed, stuck):
            write_checked(engine, p, local, 0)  # lanes open and connected
        pump = Pump(engine, live, local).start()
        stop(stuck.proc)
        hung = Pump(engine, stuck, local).start()  # its first write hangs
        pump.wait_for(20)
        doomed.proc.kill()
        doomed.proc.wait(timeout=10)
        t0 = time.monotonic()
        with pytest.raises(TransferError, match=f"lane to {doomed.session} replaced"):
            write_checked(engine, doomed, local, 1)
        t1 = time.monotonic()
        before = len(pump.spans)
        pump.wait_for(before + 50)
        assert hung.spans == [] and hung.error is None  # still hung all along
        stuck.proc.kill()  # fails the hung write at once instead of after 30 s
        assert hung.thread is not None
        hung.thread.join(timeout=30)
        pump.join()

        assert pump.error is None, pump.error
        assert isinstance(hung.error, TransferError), hung.error
        during = pump.overlapping(t0, t1)
        print(
            f"\ndead peer's failed write + lane reopen took {t1 - t0:.3f} s with a write hung "
            f"on a stopped peer; {len(during)} live write(s) overlapped, longest "
            f"{max(during, default=0) * 1e3:.1f} ms"
        )
        assert t1 - t0 < LIVE_WRITE_BOUND_S
        assert max(during, default=0) < LIVE_WRITE_BOUND_S
        assert engine.lane_generation(live.session) == 0
        assert engine.lane_generation(doomed.session) == 1
        assert engine.lane_generation(stuck.session) == 1


def test_close_lane_leaves_no_lane_behind(
    engine: MooncakeEngine, local: U8, tmp_path: Path
) -> None:
    with spawn_peers(1, tmp_path) as (peer,):
        write_checked(engine, peer, local, 0)
        raw = weakref.ref(engine._lanes[peer.session].rec.engine)
        assert engine.lane_peers() == [peer.session]

        assert engine.close_lane(peer.session) is True
        assert engine.lane_peers() == [] and engine.lane_stats() == {}
        assert raw() is None  # the lane's engine is destroyed, not just forgotten
        with pytest.raises(TransferError, match=f"no lane to {peer.session}"):
            engine.lane_generation(peer.session)
        assert engine.close_lane(peer.session) is False
        # The receiving engine keeps every span (-7: overlaps an existing registration).
        assert engine._recv is not None
        assert engine._recv.engine.register_memory(local.ctypes.data, 8) == -7

        write_checked(engine, peer, local, 1)  # a fresh lane
        assert engine.lane_generation(peer.session) == 0
        assert engine.counters()["reopens"] == 0 and engine.descriptors == 2


def test_lane_bound_closes_the_least_recently_used_idle_lane(
    engine: MooncakeEngine, local: U8, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(lane_pool, "_MAX_LANES", 2)
    with spawn_peers(3, tmp_path) as (a, b, c):
        write_checked(engine, a, local, 0)
        write_checked(engine, b, local, 1)
        write_checked(engine, a, local, 2)  # b is now the least recently used
        raw_b = weakref.ref(engine._lanes[b.session].rec.engine)
        write_checked(engine, c, local, 3)
        assert engine.lane_peers() == [a.session, c.session]
        assert raw_b() is None

        # Lanes in use are never closed under their writers: pinned as a write pins them.
        pinned = [engine._acquire_lane(a.session), engine._acquire_lane(c.session)]
        try:
            with pytest.raises(TransferError, match="all 2 lanes are in use"):
                write_checked(engine, b, local, 4)
            assert engine.lane_peers() == [a.session, c.session]
        finally:
            for lane in pinned:
                lane.unpin()
        write_checked(engine, b, local, 5)  # a was pinned first: least recently used
        assert engine.lane_peers() == [c.session, b.session]
        assert engine.counters()["reopens"] == 0


def test_registrations_reach_every_lane(engine: MooncakeEngine, local: U8, tmp_path: Path) -> None:
    """TCP reads unregistered sources too, so ask the raw engines: -7 = already registered,
    -3 = not registered."""
    second = np.ones(1 << 20, dtype=np.uint8)
    with spawn_peers(2, tmp_path) as peers:
        for i, p in enumerate(peers):
            write_checked(engine, p, local, i)
        assert engine._recv is not None
        raws = [engine._recv.engine, *(engine._lanes[p.session].rec.engine for p in peers)]
        engine.register(second.ctypes.data, second.nbytes)
        assert [r.register_memory(second.ctypes.data, 8) for r in raws] == [-7, -7, -7]
        engine.unregister_all()
        assert [r.unregister_memory(second.ctypes.data) for r in raws] == [-3, -3, -3]
        assert [r.unregister_memory(local.ctypes.data) for r in raws] == [-3, -3, -3]
        del raws
        engine.register(local.ctypes.data, local.nbytes)
        write_checked(engine, peers[0], local, 2)  # a lane opened before still writes
