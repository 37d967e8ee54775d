"""bench pd's footprint figures: peak RSS from /proc, /dev/shm held, pinned time, handoff."""

from __future__ import annotations

import math
import mmap
import os
import subprocess
import sys
import uuid
from pathlib import Path

from app.bench.pd.footprint import (
    MIB,
    footprint,
    handoff_ms,
    peak_rss_bytes,
    pinned_ms,
    reset_peak_rss,
    shm_bytes,
)


def _status(proc: Path, pid: int, hwm_kb: int) -> None:
    (proc / str(pid)).mkdir(parents=True)
    (proc / str(pid) / "status").write_text(f"Name:\tx\nVmPeak:\t999999 kB\nVmHWM:\t{hwm_kb} kB\n")


def test_peak_rss_sums_each_process_high_water_mark(tmp_path: Path) -> None:
    _status(tmp_path, 10, 1000)
    _status(tmp_path, 11, 24)
    assert peak_rss_bytes([10, 11, 12], tmp_path) == 1024 * 1024  # 12: gone, skipped
    assert math.isnan(peak_rss_bytes([12], tmp_path))


def test_reset_resets_the_peak_of_a_live_process() -> None:
    # A real process of its own (a pytest worker's peak may come from an earlier test): it
    # touches 64 MiB and drops it; its peak stays up until reset, then is about its resident set.
    code = (
        "import sys; b = bytearray(64 << 20); b[::4096] = b'x' * len(b[::4096]); del b; "
        "print('ready', flush=True); sys.stdin.read()"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        before = peak_rss_bytes([child.pid])
        reset_peak_rss([child.pid])
        after = peak_rss_bytes([child.pid])
    finally:
        child.communicate("", timeout=30)
    assert before - after > 32 * MIB, (before, after)


def test_shm_counts_the_blocks_of_a_file_held_once() -> None:
    path = Path(f"/dev/shm/kvs-test-footprint-{uuid.uuid4().hex}")
    try:
        with path.open("w+b") as f:
            f.truncate(8 * MIB)  # sparse: nothing used yet
            empty = shm_bytes([os.getpid()])
            m = mmap.mmap(f.fileno(), 8 * MIB)
            m[: 4 * MIB] = b"\1" * (4 * MIB)  # touch half
            used = shm_bytes([os.getpid(), os.getpid()])
            m.close()
        assert used - empty == 4 * MIB, (empty, used)
    finally:
        path.unlink(missing_ok=True)


def test_shm_counts_a_mapped_file_after_it_is_unlinked() -> None:
    # torch's shared tensors (the engines' KV caches) are unlinked once mapped.
    path = Path(f"/dev/shm/kvs-test-footprint-{uuid.uuid4().hex}")
    with path.open("w+b") as f:
        f.truncate(4 * MIB)
        m = mmap.mmap(f.fileno(), 4 * MIB)
    before = shm_bytes([os.getpid()])
    m[:] = b"\1" * (4 * MIB)
    path.unlink()
    try:
        assert shm_bytes([os.getpid()]) - before == 4 * MIB
    finally:
        m.close()


def test_pinned_is_the_longest_receive_record() -> None:
    records = [
        {"side": "send", "created_at": 0.0, "ended_at": 9.0},
        {"side": "recv", "created_at": 1.0, "ended_at": 1.5},
        {"side": "recv", "created_at": 2.0, "ended_at": 4.0},
        {"side": "recv", "created_at": 2.0, "ended_at": None},
    ]
    assert pinned_ms(records) == 2000.0
    assert math.isnan(pinned_ms([{"ev": "d_landed", "t": 3.0}]))  # Mooncake's: none


def test_handoff_is_ttft_less_p_start_and_forward() -> None:
    trial = {"ttft_ms": 1000.0, "p_start_ms": 30.0, "p_prefill_ms": 900.0}
    assert handoff_ms(trial) == 70.0
    fig = footprint(trial | {"transfer_records": []}, None, [])
    assert fig["handoff_ms"] == 70.0
    assert math.isnan(fig["sidecar_p_peak_rss_mib"]) and math.isnan(fig["pinned_ms"])
