"""Block ids are checked against ``[0, num_blocks)`` exactly at the boundary (DESIGN §5)."""

from __future__ import annotations

import numpy as np
import pytest

from app.errors import OutOfBoundsError
from app.kvcache.desc import LayoutDesc
from app.kvcache.groups import build_cache_config
from app.kvcache.layout import allocate
from app.kvcache.preset_registration import describe
from app.kvcache.presets import load_preset
from app.transfer.planning.planner import check_block_ids

NUM_BLOCKS = 12


@pytest.fixture(scope="module")
def desc() -> LayoutDesc:
    model = load_preset("gpt-oss-20b", layers=4)  # two groups: sliding window and full
    desc = describe(allocate(build_cache_config(model, 1, 16, num_blocks=NUM_BLOCKS), 0))
    assert len(desc.groups) == 2
    return desc


def ids(desc: LayoutDesc, *per_group: list[int]) -> list[np.ndarray]:
    assert len(per_group) == len(desc.groups)
    return [np.asarray(g, np.int64) for g in per_group]


def test_last_block_is_inside(desc: LayoutDesc) -> None:
    groups = len(desc.groups)
    check_block_ids(desc, ids(desc, *[[0, NUM_BLOCKS - 1]] * groups), "decode")
    check_block_ids(desc, ids(desc, *[[]] * groups), "decode")


@pytest.mark.parametrize("bad", [NUM_BLOCKS, -1, NUM_BLOCKS + 1000])
def test_first_block_past_either_end_is_refused(desc: LayoutDesc, bad: int) -> None:
    # Only the last group is wrong: every group is checked, not only the first.
    per_group = [[1, 2]] * (len(desc.groups) - 1) + [[3, bad]]
    with pytest.raises(OutOfBoundsError, match=rf"\[{bad}\] of group {len(desc.groups) - 1}"):
        check_block_ids(desc, ids(desc, *per_group), "decode")


def test_wrong_group_count_is_refused(desc: LayoutDesc) -> None:
    with pytest.raises(OutOfBoundsError, match="for 1 groups, the layout has 2"):
        check_block_ids(desc, [np.asarray([1], np.int64)], "prefill")
