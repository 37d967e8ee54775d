"""The KV pool end to end: a real mooncake_master, one sidecar saves, another loads."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import pytest

from app.sim.cluster import Cluster
from app.sim.commands import Command
from app.sim.rounds import summarize
from app.transfer.planning.planner import MambaMode


def _tokens(n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(0, 50_000, n).tolist()


@pytest.mark.parametrize(("model", "layers"), [("gpt-oss-20b", 4), ("qwen3-next-80b-a3b", 4)])
def test_saved_blocks_load_byte_exact_elsewhere(
    make_cluster: Callable[..., Cluster], model: str, layers: int
) -> None:
    c = make_cluster(
        model=model,
        layers=layers,
        prefill_tp=1,
        decode_tp=1,
        pool=True,
        max_requests=3,
        max_prompt=700,
    )
    a = _tokens(600)
    b = a + _tokens(100, seed=1)  # shares a's 600 tokens
    first = c.make_requests([600], tokens=[a], mamba_mode=MambaMode.ALIGN)
    assert summarize(c.run(first, chunk=256, mamba_mode=MambaMode.ALIGN), first)["verified"] == 1
    saved = c.call(c.sides["prefill"], Command(cmd="pool_save", requests=[first[0][0]]), 60)
    stats = saved["ranks"][0]["req-0"]
    assert stats["stored"] > 0 and stats["failed"] == 0 and stats["backpressure"] == 0
    # Saving again stores nothing new: the keys exist.
    again = c.call(c.sides["prefill"], Command(cmd="pool_save", requests=[first[0][0]]), 60)
    assert again["ranks"][0]["req-0"]["stored"] == 0
    assert again["ranks"][0]["req-0"]["skipped"] == stats["stored"]

    second = c.make_requests(
        [700], prefix="shared", tokens=[b], mamba_mode=MambaMode.ALIGN, full_decode_table=True
    )
    out = c.call(c.sides["decode"], Command(cmd="pool_load", requests=[second[0][1]]), 60)
    got = out["ranks"][0]["shared-0"]
    # The hit is aligned to the block size and below the shared prefix (599 computed tokens).
    bs = c.sides["decode"].allocator.config.block_size  # type: ignore[union-attr]
    assert got["hit_tokens"] == (599 // bs) * bs
    assert got["loaded"] > 0 and got["bytes"] > 0
    assert got["failed_blocks"] == [[] for _ in got["failed_blocks"]]
    assert got["problems"] == []

    # A prompt that shares nothing misses and loads nothing, at once.
    other = c.make_requests(
        [300],
        prefix="other",
        tokens=[_tokens(300, seed=9)],
        mamba_mode=MambaMode.ALIGN,
        full_decode_table=True,
    )
    miss = c.call(c.sides["decode"], Command(cmd="pool_load", requests=[other[0][1]]), 60)
    assert miss["ranks"][0]["other-0"]["hit_tokens"] == 0
    assert miss["ranks"][0]["other-0"]["loaded"] == 0


def test_full_pool_is_counted_backpressure(make_cluster: Callable[..., Cluster]) -> None:
    # 16 MiB is Mooncake's smallest segment; 4 layers x 2048 tokens x 2 KiB = 16 MiB + keys.
    c = make_cluster(
        model="gpt-oss-20b",
        layers=4,
        prefill_tp=1,
        decode_tp=1,
        pool=True,
        pool_segment_bytes=16 << 20,
        max_requests=2,
        max_prompt=4096,
    )
    pairs = c.make_requests([4096, 4096], tokens=[_tokens(4096, 1), _tokens(4096, 2)])
    assert summarize(c.run(pairs, chunk=1024), pairs)["verified"] == 2
    out = c.call(c.sides["prefill"], Command(cmd="pool_save", requests=[p for p, _ in pairs]), 120)
    results = out["ranks"][0]
    assert sum(r["backpressure"] for r in results.values()) > 0
    assert all(r["failed"] == 0 for r in results.values())


def test_killed_master_fails_clearly_without_hanging(make_cluster: Callable[..., Cluster]) -> None:
    c = make_cluster(
        model="gpt-oss-20b",
        layers=4,
        prefill_tp=1,
        decode_tp=1,
        pool=True,
        max_requests=2,
        max_prompt=256,
    )
    pairs = c.make_requests([256], tokens=[_tokens(256)])
    assert summarize(c.run(pairs), pairs)["verified"] == 1
    assert c.master is not None
    c.master.kill()
    c.master.wait(10)
    t0 = time.monotonic()
    out = c.call(c.sides["prefill"], Command(cmd="pool_save", requests=[pairs[0][0]]), 60)
    stats = out["ranks"][0]["req-0"]
    assert stats["stored"] == 0 and stats["failed"] > 0
    loaded = c.call(c.sides["decode"], Command(cmd="pool_load", requests=[pairs[0][1]]), 60)
    assert loaded["ranks"][0]["req-0"]["hit_tokens"] == 0
    assert time.monotonic() - t0 < 45
