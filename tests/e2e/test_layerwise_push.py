"""Byte-exact layer-wise transfers over the real engine, loopback TCP, separate processes."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from app.sim.cluster import Cluster
from app.sim.rounds import summarize

MODELS = {  # scaled-down presets covering every group kind
    "gpt-oss-20b": (4, None),  # sliding + full
    "qwen3-next-80b-a3b": (4, None),  # GDN + full
    "deepseek-v3.2-exp": (2, None),  # MLA + indexer
    "kimi-linear-48b-a3b": (4, None),  # KDA + MLA
}
PAIRS = [(1, 1), (2, 1), (1, 2), (4, 2)]
LAYOUTS = ("per_layer", "cross_layer")
# Every model at every TP pair, the layouts alternating: each model and each pair meets both
# layouts. The whole product (and more pairs) is planned and byte-checked in one process by
# tests/transfer/test_planner_properties.py; here the point is the processes, the engine link
# and Mooncake, and a start costs ~10 s of CPU (the product was 32 starts, 8 minutes of CI).
MATRIX = [
    (model, p_tp, d_tp, LAYOUTS[(i + j) % 2])
    for i, model in enumerate(sorted(MODELS))
    for j, (p_tp, d_tp) in enumerate(PAIRS)
]


@pytest.mark.parametrize(("model", "p_tp", "d_tp", "layout"), MATRIX)
def test_concurrent_chunked_requests_arrive_byte_exact(
    make_cluster: Callable[..., Cluster], model: str, p_tp: int, d_tp: int, layout: str
) -> None:
    arrive_byte_exact(make_cluster, model, p_tp, d_tp, layout=layout)


def arrive_byte_exact(
    make_cluster: Callable[..., Cluster], model: str, p_tp: int, d_tp: int, **spec: object
) -> Cluster:
    """Three chunked requests of one matrix point arrive byte-exact, nothing else touched."""
    layers, block = MODELS[model]
    lens = [300, 517, 64]
    cluster = make_cluster(
        model=model,
        layers=layers,
        prefill_tp=p_tp,
        decode_tp=d_tp,
        block_size=block,
        max_requests=len(lens),
        max_prompt=max(lens),
        **spec,
    )
    pairs = cluster.make_requests(lens)
    result = cluster.run(pairs, chunk=128)
    s = summarize(result, pairs)
    assert s["failures"] == {}
    assert s["verified"] == len(lens)
    assert s["bytes"] > 0 and s["descriptors"] > 0
    assert cluster.untouched(pairs) == []
    return cluster


def test_requests_of_equal_length_land_in_their_own_blocks(
    make_cluster: Callable[..., Cluster],
) -> None:
    """Two prompts of one length: swapping their decode blocks writes every byte at the right
    position of the wrong request, which only a fill that differs per request can see."""
    lens = [256, 256]
    cluster = make_cluster(
        model="gpt-oss-20b", layers=4, prefill_tp=1, decode_tp=1, max_requests=2, max_prompt=256
    )
    pairs = cluster.make_requests(lens)
    s = summarize(cluster.run(pairs), pairs)
    assert s["failures"] == {} and s["verified"] == len(lens)
    assert cluster.untouched(pairs) == []


@pytest.mark.parametrize(("p_tp", "d_tp"), [(2, 1), (1, 2), (4, 2)])
@pytest.mark.parametrize("model", ["qwen3-next-80b-a3b", "kimi-linear-48b-a3b"])
def test_conv_states_in_the_ds_layout_arrive_byte_exact(
    make_cluster: Callable[..., Cluster], model: str, p_tp: int, d_tp: int
) -> None:
    """Conv states stored (dim, state) instead of (state, dim): each rank's share of the dim
    axis is then rows, not columns, and the TP split must follow it."""
    lens = [300, 517]
    cluster = make_cluster(
        model=model,
        layers=MODELS[model][0],
        prefill_tp=p_tp,
        decode_tp=d_tp,
        conv_layout="DS",
        max_requests=len(lens),
        max_prompt=max(lens),
    )
    pairs = cluster.make_requests(lens)
    s = summarize(cluster.run(pairs, chunk=128), pairs)
    assert s["failures"] == {}
    assert s["verified"] == len(lens)
    assert cluster.untouched(pairs) == []
