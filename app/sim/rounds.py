"""What a driver makes of a cluster's runs: ``summarize`` (one line of numbers per run) and
``pool_round`` (a transfer, a pool save, a pool load and its check)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from app.kvcache.groups import build_cache_config
from app.kvcache.presets import load_preset
from app.sim.commands import Command, SimRequest
from app.transfer.planning.planner import MambaMode

if TYPE_CHECKING:
    from app.sim.cluster import Cluster, ClusterSpec


def summarize(
    result: dict[str, Any],
    pairs: Sequence[tuple[SimRequest, SimRequest]],
    bytes_before: int = 0,
    desc_before: int = 0,
) -> dict[str, Any]:
    """One line of numbers for a run: requests verified on every D rank, bytes, GB/s."""
    ids = [pr.id for pr, _ in pairs]
    decode, prefill = result["decode"]["ranks"], result["prefill"]["ranks"]
    verified = [i for i in ids if all(i in r["verified"] for r in decode)]
    failed: dict[str, Any] = {}
    for r in [*decode, *prefill]:
        for rid, f in r["failed"].items():
            failed.setdefault(rid, f)
    for r in decode:
        for rid, problems in r["problems"].items():
            failed.setdefault(
                rid, {"status": "CORRUPT", "error": "; ".join(problems[:3]), "blocks": []}
            )
    nbytes = sum(r["bytes"] for r in prefill) - bytes_before
    desc = sum(r["descriptors"] for r in prefill) - desc_before
    end = result["decode"]["arrived_at"]
    last_layer = result["prefill"]["last_layer_at"]
    seconds = max(1e-9, end - result["started"])
    return {
        "requests": len(ids),
        "verified": len(verified),
        "failed": len(failed),
        "failures": failed,
        "bytes": nbytes,
        "seconds": round(seconds, 4),
        "gbps": round(nbytes / seconds / 1e9, 4),
        "descriptors": desc,
        "exposed_ms": round(max(0.0, end - last_layer) * 1e3, 3),
    }


def pool_prompt_tokens(spec: ClusterSpec, prompt_tokens: int) -> int:
    """Request A's length in ``pool_round``: at least two whole blocks on both sides, or a
    hybrid's large blocks (544-1920 tokens) would leave nothing to share."""
    model = load_preset(spec.model, layers=spec.layers)
    bs = spec.block_size or model.default_block_size()
    blocks = [
        build_cache_config(model, tp, bs, num_blocks=2).block_size
        for tp in (spec.prefill_tp, spec.decode_tp)
    ]
    return max(prompt_tokens, 2 * max(blocks) + 8)


def pool_round(cluster: Cluster, prompt_tokens: int, *, seed: int = 0) -> dict[str, Any]:
    """Request A goes P -> D and is saved to the pool by P; request B = A + a suffix is looked
    up at D, loaded from the pool and verified there (what ``demo --pool`` shows)."""
    rng = np.random.default_rng(seed)
    n = pool_prompt_tokens(cluster.spec, prompt_tokens)
    a = rng.integers(0, 50_000, n).tolist()
    b = a + rng.integers(0, 50_000, n // 4).tolist()
    align = MambaMode.ALIGN
    first = cluster.make_requests([len(a)], "pool-a", mamba_mode=align, tokens=[a])
    moved = summarize(cluster.run(first, mamba_mode=align), first)
    saved = cluster.call(
        cluster.sides["prefill"], Command(cmd="pool_save", requests=[first[0][0]]), 120
    )
    second = cluster.make_requests(
        [len(b)], "pool-b", mamba_mode=align, tokens=[b], full_decode_table=True
    )
    # Pool keys carry the TP namespace: with equal TP sizes decode loads what prefill saved;
    # otherwise a later prefill of B hits the pool (prefix caching at prefill).
    same_tp = cluster.spec.prefill_tp == cluster.spec.decode_tp
    loader = "decode" if same_tp else "prefill"
    req = second[0][1] if same_tp else second[0][0]
    loaded = cluster.call(cluster.sides[loader], Command(cmd="pool_load", requests=[req]), 120)
    per_rank = [r["pool-b-0"] for r in loaded["ranks"]]
    return {
        "pool_transfer_verified": moved["verified"] == 1,
        "pool_saved_keys": sum(r["pool-a-0"]["stored"] for r in saved["ranks"]),
        "pool_backpressure": sum(r["pool-a-0"]["backpressure"] for r in saved["ranks"]),
        "pool_hit_tokens": min(r["hit_tokens"] for r in per_rank),
        "pool_loaded_bytes": sum(r["bytes"] for r in per_rank),
        "pool_loaded_by": loader,
        "pool_verified": all(
            r["hit_tokens"] > 0 and not r["problems"] and not any(r["failed_blocks"])
            for r in per_rank
        ),
    }
