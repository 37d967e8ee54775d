"""A window larger than 1024 tokens (Gemma 3: 1024 on five layers of six) with prompts longer
than it: decode reads only the blocks the window covers, so the blocks before it must keep
whatever they held (a sentinel here), while the full-attention layers get every token."""

from __future__ import annotations

from collections.abc import Callable

from app.sim.cluster import Cluster
from app.sim.rounds import summarize

SENTINEL = 0x6E111A


def test_prompts_longer_than_a_1024_token_window_send_only_the_window(
    make_cluster: Callable[..., Cluster],
) -> None:
    # 2096 tokens: about the first 1000 lie before the window; 1040 barely crosses it; 704
    # never does. Whole 16-token kernel blocks: the last partial kernel block of a prompt is
    # sent whole (tokens past the prompt, which decode overwrites before it reads them), and
    # that would count as changed outside the read set.
    lens = [2096, 1040, 704]
    cluster = make_cluster(
        model="gemma-3-27b",
        layers=6,
        prefill_tp=2,
        decode_tp=1,
        max_requests=len(lens),
        max_prompt=max(lens),
        sentinel=SENTINEL,
    )
    pairs = cluster.make_requests(lens)
    s = summarize(cluster.run(pairs, chunk=512), pairs)
    assert s["failures"] == {} and s["verified"] == len(lens)
    changed, problems = cluster.changed_outside(pairs)
    assert problems == [], problems
    # The full-attention layer and the windows were written: something changed.
    assert changed == 0 and s["bytes"] > 0
