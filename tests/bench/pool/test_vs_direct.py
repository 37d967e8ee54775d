"""``bench pool-vs-direct`` moves the same bytes both ways on real Mooncake (a master, a
process holding the pool's segment, a raw-write peer) and reports each way's own A/A floor."""

from __future__ import annotations

import pytest

from app.bench.pool.vs_direct import PoolVsDirectOptions, run

pytestmark = pytest.mark.bench_run


def test_both_ways_move_the_same_bytes_and_report_their_noise() -> None:
    sizes = (256 << 10, 1 << 20)
    result = run(PoolVsDirectOptions(sizes, 4 << 20, reps=4))
    rows = result["rows"]
    assert [r["object_bytes"] for r in rows] == list(sizes)
    for r in rows:
        # run() raises unless every pool load landed byte for byte
        assert r["objects"] * r["object_bytes"] == r["bytes"] == 4 << 20
        assert r["pool_load_ms"]["n"] == r["direct_ms"]["n"] == 4
        assert r["pool_load_ms"]["min"] > 0 and r["direct_ms"]["min"] > 0
        assert r["aa_pool"] > 0 and r["aa_direct"] > 0
