"""``bench chat-keys``' result as docs/benchmarks.md shows it: a row per chat template, how much
of each answer the next turn's rendered prompt gives back as decode stored it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from app.bench.core.tables import Table, num

LABELS = {  # the result's template names, as the docs name them
    "qwen2.5": "Qwen2.5 (ChatML)",
    "llama3": "Llama 3",
    "gemma3": "Gemma 3",
    "deepseek-v3": "DeepSeek-V3",
    "qwen3-thinking": "Qwen3, thinking",
    "qwen3-no-thinking": "Qwen3, `enable_thinking=False`",
}
HEADER = (
    "template",
    "answer tokens the next turn shares",
    "turns parted",
    "16-token blocks gained / the answer's",
    "proxy index credit (median)",
)


def _shared(share: float) -> str:
    text = f"{num(100 * share)}%"
    return f"**{text}**" if share == 0 else text  # none of the answer comes back: the finding


def _parted(s: Mapping[str, Any]) -> str:
    text = f"{s['parted_turns']} / {s['turns']}"
    at = s["parted_at_median"]
    if at is None:
        return text
    if at == 0:
        return f"{text}, at the answer's first token"
    where = "before the answer" if at < 0 else "into the answer"
    return f"{text}, {num(abs(at))} tokens {where}"


def templates(result: Mapping[str, Any]) -> Table:
    rows = tuple(
        (
            LABELS.get(name, name),
            _shared(t["summary"]["answer_shared_share"]),
            _parted(t["summary"]),
            f"{t['summary']['gained_blocks']['16']} / {t['summary']['answer_blocks']['16']}",
            f"{num(100 * t['summary']['proxy_hit_share_median'])}%",
        )
        for name, t in result["templates"].items()
    )
    return Table(HEADER, rows)
