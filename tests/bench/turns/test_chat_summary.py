"""``bench turns --api chat``'s summary: the computed-tokens bound at turns >= 3 counts the
chat template's markers of the turn (``template_tokens``) beside the new message and one block,
and the turns whose prompt kept the previous prompt and answer are counted per system."""

from __future__ import annotations

from typing import Any

from app.bench.turns.summary import BLOCK, summarize
from tests.bench.turns.test_summary import SC, W, rows_of


def chat_rows(computed: float, template: int, kept: bool | None) -> list[dict[str, Any]]:
    rows = rows_of(SC, (300, 200, 100), computed)
    return [{**r, "template_tokens": template, "prefix_kept": kept} for r in rows]


def test_the_bound_counts_the_templates_markers() -> None:
    new = rows_of(SC, (1, 1, 1), 0)[0]["new_tokens"]
    at = summarize(chat_rows(new + 4 + BLOCK, 4, True), W)
    assert at["computed_over_new_plus_block"] == {SC: 0}
    assert at["per_turn"][SC]["3"]["template_tokens"] == 4
    over = summarize(chat_rows(new + 4 + BLOCK + 1, 4, True), W)
    assert over["computed_over_new_plus_block"] == {SC: W.conversations}
    assert {o["template_tokens"] for o in over["over"]} == {4}
    # The completions path's rows have no markers: the bound is the message and a block.
    plain = summarize(rows_of(SC, (1, 1, 1), new + BLOCK + 1), W)
    assert plain["computed_over_new_plus_block"] == {SC: W.conversations}


def test_turns_that_kept_the_prefix_are_counted() -> None:
    rows = chat_rows(0, 4, True)
    rows[-1] = {**rows[-1], "prefix_kept": False}
    rows[0] = {**rows[0], "prefix_kept": None}  # turn 1: nothing to keep
    s = summarize(rows, W)
    assert s["prefix_kept"] == {SC: {"kept": len(rows) - 2, "checked": len(rows) - 1}}
    assert summarize(rows_of(SC, (1, 1, 1), 0), W)["prefix_kept"] == {SC: {"kept": 0, "checked": 0}}
