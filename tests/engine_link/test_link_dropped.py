"""A link dropped without ``close()`` (a connector nobody closed, a test) is collected without
hanging: a ZMQ context collected before its socket's monitor is disabled blocks forever in
``term()``, and once did, stalling a whole test worker. Run in a child process, which would
hang instead of this one."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

CHILD = """
import gc, sys, time
from app.engine_link.client import EngineLink
links = [EngineLink(sys.argv[1], "engine", rank) for rank in range(2)]
time.sleep(0.3)  # the monitors are live
del links
gc.collect()
print("collected")
"""


def test_a_dropped_link_is_collected_without_hanging(tmp_path: Path) -> None:
    endpoint = f"ipc://{tmp_path}/nobody.ipc"
    r = subprocess.run(
        [sys.executable, "-c", CHILD, endpoint],
        capture_output=True,
        text=True,
        timeout=60,  # imports; the collection itself takes milliseconds
        check=False,
    )
    assert (r.returncode, r.stdout.strip()) == (0, "collected"), r.stderr[-2000:]
