"""Chaos scenarios: real sidecars, engines, Mooncake over loopback, ZMQ and admin HTTP, one
fault each. ``chaos`` starts a cluster whose decode cache holds a sentinel pattern; the table
of every scenario's figures is printed at the end of the run."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from app.sim.cluster import Cluster, ClusterSpec
from tests.chaos.harness import ROWS, SENTINEL, Chaos

# Faults should end requests in seconds: acks, handshakes and engine calls time out fast.
FAST = {"KVSIDECAR_ACK_TIMEOUT_S": "2", "KVSIDECAR_HANDSHAKE_TIMEOUT_S": "3"}

# Qwen3-Next scaled to 8 layers (6 Gated-DeltaNet state layers, 2 full attention), P TP 2 ->
# D TP 1: two senders per decode rank, state and attention both cross TP sizes.
DEFAULT: dict[str, Any] = {
    "model": "qwen3-next-80b-a3b",
    "layers": 8,
    "prefill_tp": 2,
    "decode_tp": 1,
    "max_requests": 4,
    "max_prompt": 1024,
    "engine_link_timeout_s": 2.0,
    "engine_link_lease_s": 3.0,
}


@pytest.fixture
def chaos(tmp_path: Path) -> Iterator[Callable[..., Chaos]]:
    """``chaos(name, **ClusterSpec fields)``: a started cluster under a scenario name."""
    made: list[Chaos] = []

    def make(name: str, **kw: Any) -> Chaos:
        spec = {**DEFAULT, **kw}
        spec["sidecar_env"] = {**FAST, **kw.get("sidecar_env", {})}
        cluster = Cluster(ClusterSpec(log_dir=str(tmp_path), sentinel=SENTINEL, **spec))
        cluster.__enter__()
        made.append(Chaos(cluster, name))
        return made[-1]

    yield make
    for ch in made:
        ch.close()
    for log in sorted(tmp_path.glob("*.log")):
        text = log.read_text(errors="replace")
        if "Traceback" in text:
            print(f"---- {log.name} (tail) ----\n{text[-3000:]}")


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not ROWS:
        return
    tr = terminalreporter
    tr.section("chaos scenarios")
    head = (
        f"{'scenario':<38} {'requests':>8} {'terminal':>8} {'lost':>5} "
        f"{'bytes changed outside':>21} {'late':>5} {'to terminal s':>13}  outcome"
    )
    tr.write_line(head)
    for r in ROWS:
        secs = "-" if r.seconds is None else f"{r.seconds:.2f}"
        verdict = (
            "ok"
            if not r.failed
            else "FAILED checks " + ",".join(sorted({f.split(":", 1)[0] for f in r.failed}))
        )
        changed = "-" if r.changed is None else r.changed
        late = "-" if r.late is None else r.late
        tr.write_line(
            f"{r.scenario:<38} {r.requests:>8} {r.terminal:>8} {r.lost:>5} {changed:>21} "
            f"{late:>5} {secs:>13}  {r.outcome} [{verdict}]"
        )
