"""``bench turns``' result (against vLLM's MooncakeConnector, with the ablation without answers)
as docs/benchmarks.md shows it: a row per turn index, means over the conversations; kv-sidecar's
prefill computed in bold from turn 2, where the pool's answers count."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from app.bench.core.tables import Table, num

SIDECAR, AA, NO_ANSWERS, MOONCAKE = (
    "kv-sidecar",
    "kv-sidecar-aa",
    "kv-sidecar-no-answers",
    "mooncake",
)


def _table(result: Mapping[str, Any], loaded: bool) -> Table:
    per = result["summary"]["per_turn"]
    header = [
        "turn",
        "new message",
        "history",
        "prefill computed: kv-sidecar / no answers / mooncake",
        *(["kv-sidecar loaded from the pool"] if loaded else []),
        "TTFT P50 ms: kv-sidecar / kv-sidecar-aa / no answers / mooncake",
    ]
    rows = []
    for turn, mine in sorted(per[SIDECAR].items(), key=lambda kv: int(kv[0])):
        computed = num(mine["prefill_computed"])
        if int(turn) > 1:
            computed = f"**{computed}**"
        others = (num(per[s][turn]["prefill_computed"]) for s in (NO_ANSWERS, MOONCAKE))
        rows.append(
            (
                turn,
                num(mine["new_tokens"]),
                num(mine["history_tokens"]),
                " / ".join((computed, *others)),
                *([num(mine["prefill_loaded"])] if loaded else []),
                " / ".join(
                    num(per[s][turn]["ttft_p50_ms"]) for s in (SIDECAR, AA, NO_ANSWERS, MOONCAKE)
                ),
            )
        )
    return Table(tuple(header), tuple(rows))


def with_loaded(result: Mapping[str, Any]) -> Table:
    return _table(result, loaded=True)


def without_loaded(result: Mapping[str, Any]) -> Table:
    return _table(result, loaded=False)
