"""The ring's state table works across processes: the engine end runs in a subprocess
(``_ring_engine.py``), the sidecar end here, and they agree on every use of every slot."""

from __future__ import annotations

import select
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from app.devices.events import SidecarRing
from app.devices.spec import EventRingSpec
from app.errors import DeadlineExceeded

pytestmark = pytest.mark.timeout(60)

SCRIPT = Path(__file__).with_name("_ring_engine.py")


class Engine:
    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc

    def line(self, timeout_s: float = 10.0) -> str | None:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        return self.proc.stdout.readline().strip() if ready else None

    def send(self, cmd: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()

    def ask(self, cmd: str) -> str | None:
        self.send(cmd)
        return self.line()


@pytest.fixture
def engine() -> Iterator[Engine]:
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).parents[2],
    )
    try:
        yield Engine(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


def test_engine_and_sidecar_in_two_processes_share_the_table(engine: Engine) -> None:
    first = engine.line(30)
    assert first, "the engine process printed no ring spec"
    spec = msgspec.json.decode(first, type=EventRingSpec)
    side = SidecarRing.open(spec)

    assert engine.ask("record 0 held") == "0 1"
    assert engine.ask("record 1") == "0 1"
    side.wait(1, 0, 1, 1.0)  # layer 1 had no event: complete when recorded
    with pytest.raises(DeadlineExceeded):
        side.wait(0, 0, 1, 0.3)  # its event is still pending in the engine process
    assert engine.ask("complete") == "ok"
    side.wait(0, 0, 1, 5.0)

    assert engine.ask("record 0") == "1 2"  # the other slot: free
    engine.send("record 0")  # use 3 needs slot 0, which the sidecar still holds
    assert engine.line(0.5) is None, "the engine took slot 0 before the sidecar released it"
    side.release(0, 0, 1)
    assert engine.line(10) == "0 3"

    engine.send("quit")
    assert engine.proc.wait(10) == 0
    # The engine removed the name at close; the sidecar's mapping still reads the table.
    assert not (Path("/dev/shm") / spec.table).exists()
    assert side.done(0, 0, 3) and side.done(0, 1, 2)
