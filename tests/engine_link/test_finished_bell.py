"""The finished bell on real sidecar processes (``app.devices.bell``): an engine link that asked
its sidecar and heard nothing since does not ask again until a request of its rank ended (the
sidecar rang) or ``SAFETY_S`` passed; a transfer that ends rings both sides at once."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from app.devices.bell import SAFETY_S
from app.devices.shm import SHM_DIR
from app.engine_link.client import EngineLink
from app.transfer.wire.protocol import StepSlice
from tests.devices.harness import PARAMS, Pair, start_pair

pytestmark = pytest.mark.timeout(240)

PROMPT = 64


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    sockets = Path(tempfile.mkdtemp(prefix="kvs-bell-", dir="/dev/shm"))  # short ipc paths
    p = start_pair(sockets, tmp_path_factory.mktemp("bell"), PARAMS)
    try:
        yield p
    finally:
        p.close()
        shutil.rmtree(sockets, ignore_errors=True)


def rung_within(link: EngineLink, limit_s: float) -> float | None:
    """Seconds until ``link`` may have something to collect, None if not within ``limit_s``."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit_s:
        if link.may_have_finished():
            return time.monotonic() - t0
        time.sleep(0.001)
    return None


def test_each_rank_has_a_bell_and_its_name_is_gone(pair: Pair) -> None:
    for link in (pair.p, pair.d):
        bell = link.bell.bell
        assert bell is not None, "the sidecar did not map the engine's bell"
        assert not os.path.exists(os.path.join(SHM_DIR, bell.name))


def test_an_ended_transfer_rings_both_sides_and_silence_does_not(pair: Pair) -> None:
    rid = "bell-1"
    p_ids, d_ids = [np.arange(1, 5, dtype=np.int64)], [np.arange(9, 13, dtype=np.int64)]
    pair.d.expect_receive(rid, PROMPT, d_ids, prefill_tp=1)
    pair.poll(pair.d)
    pair.poll(pair.p)
    # Nothing ended since those asks: no round trip is due (well inside the safety interval).
    assert rung_within(pair.d, 0.3 * SAFETY_S) is None
    assert rung_within(pair.p, 0.05) is None

    pair.poll(pair.d)  # the safety interval runs from here...
    pair.poll(pair.p)
    pair.send(rid, PROMPT, p_ids, d_ids)
    pair.p.begin_step(1, [StepSlice(rid, 0, PROMPT)])
    for layer in sorted(pair.p_layout.placements):
        pair.p.layer_ready(1, layer)
    # ...and the end of the transfer rings each side long before it would ask anyway.
    for link in (pair.d, pair.p):
        waited = rung_within(link, 2 * SAFETY_S)
        assert waited is not None and waited < 0.5 * SAFETY_S, waited
    assert pair.wait_end(pair.d, rid, 10) == "DONE"
    assert pair.wait_end(pair.p, rid, 10) == "DONE"


def test_silence_still_asks_once_per_safety_interval(pair: Pair) -> None:
    pair.poll(pair.d)
    waited = rung_within(pair.d, 3 * SAFETY_S)
    assert waited is not None and 0.9 * SAFETY_S <= waited <= 1.5 * SAFETY_S, waited


def test_a_dead_sidecar_is_seen_at_once_not_at_the_next_safety_ask(pair: Pair) -> None:
    """Last in this module: it kills decode's sidecar. Its bell never rings again; the link's
    own view of the connection makes the next step ask (and fail) without waiting a second."""
    pair.poll(pair.d)
    pair.decode.proc.kill()
    waited = rung_within(pair.d, 0.9 * SAFETY_S)
    assert waited is not None, "a dead sidecar was seen only at the safety ask"
