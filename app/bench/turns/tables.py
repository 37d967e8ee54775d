"""``bench turns``' result (against vLLM's MooncakeConnector, with the ablation without answers)
as docs/benchmarks.md shows it: a row per turn index, means over the conversations; kv-sidecar's
prefill computed in bold from turn 2, where the pool's answers count."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from app.bench.core.store_pd import STORE_PEER
from app.bench.core.tables import Table, num

SIDECAR, AA, NO_ANSWERS, MOONCAKE = (
    "kv-sidecar",
    "kv-sidecar-aa",
    "kv-sidecar-no-answers",
    "mooncake",
)


def _computed(per: Mapping[str, Any], turn: str) -> str:
    """Prefill computed, kv-sidecar / no answers / mooncake; kv-sidecar's in bold from turn 2."""
    mine = num(per[SIDECAR][turn]["prefill_computed"])
    if int(turn) > 1:
        mine = f"**{mine}**"
    others = (num(per[s][turn]["prefill_computed"]) for s in (NO_ANSWERS, MOONCAKE))
    return " / ".join((mine, *others))


def _ttft(per: Mapping[str, Any], turn: str) -> str:
    """TTFT P50, kv-sidecar / its A/A / no answers / mooncake."""
    return " / ".join(num(per[s][turn]["ttft_p50_ms"]) for s in (SIDECAR, AA, NO_ANSWERS, MOONCAKE))


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
        rows.append(
            (
                turn,
                num(mine["new_tokens"]),
                num(mine["history_tokens"]),
                _computed(per, turn),
                *([num(mine["prefill_loaded"])] if loaded else []),
                _ttft(per, turn),
            )
        )
    return Table(tuple(header), tuple(rows))


def with_loaded(result: Mapping[str, Any]) -> Table:
    return _table(result, loaded=True)


def without_loaded(result: Mapping[str, Any]) -> Table:
    return _table(result, loaded=False)


def _store_table(result: Mapping[str, Any], forward: bool) -> Table:
    per = result["summary"]["per_turn"]
    pair = (SIDECAR, STORE_PEER)

    def both(turn: str, key: str) -> list[str]:
        return [num(per[s][turn][key]) for s in pair]

    header = [
        "turn",
        "new message",
        "history",
        "prefill computed: kv-sidecar / store peer",
        "loaded: kv-sidecar (pool) / store peer (store)",
        "TTFT P50 ms: kv-sidecar / store peer",
        *(["prefill forward P50 ms"] if forward else []),
    ]
    rows = []
    for turn, mine in sorted(per[SIDECAR].items(), key=lambda kv: int(kv[0])):
        computed = both(turn, "prefill_computed")
        if int(turn) > 1:
            computed[0] = f"**{computed[0]}**"
        rows.append(
            (
                turn,
                num(mine["new_tokens"]),
                num(mine["history_tokens"]),
                " / ".join(computed),
                " / ".join(both(turn, "prefill_loaded")),
                " / ".join(both(turn, "ttft_p50_ms")),
                *([" / ".join(both(turn, "p_forward_p50_ms"))] if forward else []),
            )
        )
    return Table(tuple(header), tuple(rows))


def store(result: Mapping[str, Any]) -> Table:
    """Against the store-equipped peer (its answers through Mooncake's store)."""
    return _store_table(result, forward=False)


def store_forward(result: Mapping[str, Any]) -> Table:
    """The same, with prefill's forward pass P50 on each system."""
    return _store_table(result, forward=True)


def tails(result: Mapping[str, Any]) -> Table:
    """Against MooncakeConnector with prompts' partial blocks stored too: no history column, and
    prefill's forward pass P50 of kv-sidecar with and without answers."""
    per = result["summary"]["per_turn"]
    header = (
        "turn",
        "new message",
        "prefill computed: kv-sidecar / no answers / mooncake",
        "kv-sidecar loaded",
        "TTFT P50 ms: kv-sidecar / kv-sidecar-aa / no answers / mooncake",
        "prefill's forward P50 ms: kv-sidecar / no answers",
    )
    rows = []
    for turn, mine in sorted(per[SIDECAR].items(), key=lambda kv: int(kv[0])):
        rows.append(
            (
                turn,
                num(mine["new_tokens"]),
                _computed(per, turn),
                num(mine["prefill_loaded"]),
                _ttft(per, turn),
                " / ".join(num(per[s][turn]["p_forward_p50_ms"]) for s in (SIDECAR, NO_ANSWERS)),
            )
        )
    return Table(header, tuple(rows))
