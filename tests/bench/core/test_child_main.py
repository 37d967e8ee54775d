"""``core.netns.child_main``: what ``run_child`` starts in the namespace (``bench load``, ``bench
soak``) reads its options file, runs, and writes the result with the host to the options' ``out``.

It runs in a process of its own, as ``run_child`` starts it (it installs signal handlers)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from app.bench.core.result_file import split_host

CHILD = """
import json, sys
from dataclasses import dataclass
from app.bench.core.host import NO_LINK, host_record
from app.bench.core.netns import child_main

@dataclass(frozen=True)
class Opts:
    out: str
    n: int

def run(opts):
    return {"n": opts.n, "twice": 2 * opts.n}, host_record(engines={}, link=NO_LINK)

child_main(None, lambda text: Opts(**json.loads(text)), run, "r.json")
"""


def test_the_result_lands_in_out_with_the_host(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    options = tmp_path / "options.json"
    options.write_text(json.dumps({"out": str(out), "n": 21}))
    r = subprocess.run(
        [sys.executable, "-c", CHILD, str(options)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert r.returncode == 0, r.stderr
    payload, host = split_host(json.loads((out / "r.json").read_text()))
    assert payload == {"n": 21, "twice": 42}
    assert host.link == "none: nothing crosses a link"
