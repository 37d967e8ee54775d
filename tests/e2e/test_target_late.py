"""Concurrent dispatch through the simulator's byte-exact oracle: prefill admits without
decode's target and computes; the target arrives mid-prompt (after 3 layer signals of the
first chunk) or after the whole forward pass, through each rank's engine link or posted once
to prefill's admin API (the prefill-first flow);
every request lands byte-exact and nothing outside decode's read sets changes (the whole cache
holds a sentinel first), for every group kind and TP pairing that splits or replicates."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from app.sim.cluster import Cluster
from app.sim.rounds import summarize

AFTER_ALL = 10**6  # past the last signal: the target comes after the forward pass
# model, layers, P TP, D TP, target after this many layer signals, posted to P's admin API
# (prefill first: once per request, every rank takes it) rather than through each rank's link
CASES = [
    ("gpt-oss-20b", 4, 1, 2, 3, False),  # sliding + full
    ("qwen3-next-80b-a3b", 4, 2, 1, AFTER_ALL, False),  # GDN + full
    ("deepseek-v3.2-exp", 2, 1, 1, 3, False),  # MLA + indexer
    ("kimi-linear-48b-a3b", 4, 2, 2, AFTER_ALL, False),  # KDA + MLA
    ("qwen3-next-80b-a3b", 4, 2, 1, AFTER_ALL, True),
    ("gpt-oss-20b", 4, 1, 2, AFTER_ALL, True),
]


@pytest.mark.parametrize(
    ("model", "layers", "p_tp", "d_tp", "after", "via_admin"),
    CASES,
    ids=[f"{c[0]}{'-admin' if c[5] else ''}" for c in CASES],
)
def test_late_target_lands_byte_exact(
    make_cluster: Callable[..., Cluster],
    model: str,
    layers: int,
    p_tp: int,
    d_tp: int,
    after: int,
    via_admin: bool,
) -> None:
    # Prompts of whole kernel blocks plus the token decode computes: the planner writes a
    # partial last kernel block whole, which the sentinel would see outside the read set.
    lens = [257, 513, 65]
    cluster = make_cluster(
        model=model,
        layers=layers,
        prefill_tp=p_tp,
        decode_tp=d_tp,
        max_requests=len(lens),
        max_prompt=max(lens),
        sentinel=0x5E471E1,
    )
    pairs = cluster.make_requests(lens)
    result = cluster.run(pairs, chunk=128, target_after_layers=after, target_via_admin=via_admin)
    s = summarize(result, pairs)
    assert s["failures"] == {}
    assert s["verified"] == len(lens)
    assert s["bytes"] > 0
    assert cluster.untouched(pairs) == []
