"""A failed load's blocks are zeroed before vLLM frees them (failed_loads.py): every attention
page the load could have written (past the engine's own prefix hit, every kernel block of each
block), never a shared prefix block, a block of a load that went well, a Mamba state, or the
blocks of a request vLLM finished first (an abort frees them at once: they may be another's)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

import torch

from app.connectors.vllm.failed_loads import FailedLoads
from app.kvcache.engine_spec import EngineRegistration

BLOCKS = 8


def engine() -> tuple[FailedLoads, dict[str, torch.Tensor]]:
    """Full attention (blocks of 32 tokens, kernel blocks of 16) and a Mamba group; every
    byte NaN, as bytes flipped in flight can leave them."""
    groups = [
        SimpleNamespace(kind="full", block_size=32, kernel_block_size=16),
        SimpleNamespace(kind="mamba", block_size=32, kernel_block_size=32),
    ]
    layers = [SimpleNamespace(name=n, group=g) for n, g in (("a0", 0), ("a1", 0), ("m", 1))]
    caches = {
        "a0": torch.full((2 * BLOCKS, 2, 4), float("nan")),
        "a1": torch.full((2 * BLOCKS, 2, 4), float("nan")),
        "m": torch.full((BLOCKS, 3), float("nan")),
    }
    loads = FailedLoads()
    reg = SimpleNamespace(groups=groups, layers=layers)
    loads.register(cast(EngineRegistration, reg), cast(dict[str, Any], caches))
    return loads, caches


def zeroed(t: torch.Tensor) -> list[int]:
    """Indices along dim 0 whose every value is 0."""
    return [i for i in range(t.shape[0]) if bool((t[i] == 0).all())]


def test_a_failed_load_zeroes_its_pages_past_the_prefix_hit() -> None:
    loads, caches = engine()
    loads.expect("r", [[1, 4, 6], [2]], held_tokens=32)  # block 1: the engine's own hit
    loads.expect("ok", [[3], [5]], held_tokens=0)
    loads.ended(finished=set(), loaded={"ok"}, failed={"r"})
    for name in ("a0", "a1"):  # blocks 4 and 6: kernel blocks 8, 9 and 12, 13
        assert zeroed(caches[name]) == [8, 9, 12, 13], name
    assert zeroed(caches["m"]) == []  # a state is recomputed from zero, not read
    # Reported once: a later failure of the same id zeroes nothing more.
    caches["a0"].fill_(float("nan"))
    loads.ended(finished=set(), loaded=set(), failed={"r", "ok"})
    assert zeroed(caches["a0"]) == []


def test_a_request_vllm_finished_first_is_not_zeroed() -> None:
    loads, caches = engine()
    loads.expect("aborted", [[2, 3], [1]], held_tokens=0)
    loads.ended(finished={"aborted"}, loaded=set(), failed={"aborted"})
    assert zeroed(caches["a0"]) == zeroed(caches["a1"]) == []


def test_a_pool_load_failed_in_part_is_zeroed() -> None:
    loads, caches = engine()
    loads.expect("p", [[0, 5, 7], [3]], held_tokens=0)  # 0: vLLM's null block, never zeroed
    loads.ended(finished=set(), loaded={"p"}, failed={"p"})
    assert zeroed(caches["a0"]) == [10, 11, 14, 15]
