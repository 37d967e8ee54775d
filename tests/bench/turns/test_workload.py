"""``bench turns``' conversations: seeded, lengths within their bounds, a second draw of other
tokens with the same lengths, and the order that interleaves them."""

from __future__ import annotations

import pytest

from app.bench.turns.workload import TurnsWorkload, conversations, in_turn_order
from app.errors import ConfigError


def test_lengths_stay_in_their_bounds_and_the_draw_is_seeded() -> None:
    w = TurnsWorkload(conversations=5, turns=6, first_tokens=300, long_share=0.5, seed=3)
    convs = conversations(w)
    assert convs == conversations(w)
    assert [len(c) for c in convs] == [6] * 5
    for c in convs:
        assert len(c[0].tokens) == 300 and c[0].turn == 1
        for m in c[1:]:
            lo, hi = w.long if m.long else w.short
            assert lo <= len(m.tokens) <= hi
    kinds = {m.long for c in convs for m in c[1:]}
    assert kinds == {True, False}, "a share of 0.5 over 25 turns draws both kinds"


def test_a_second_draw_has_other_tokens_of_the_same_lengths() -> None:
    w = TurnsWorkload(conversations=3, turns=3)
    a, b = conversations(w), conversations(w, salt=1)
    assert [[len(m.tokens) for m in c] for c in a] == [[len(m.tokens) for m in c] for c in b]
    assert all(
        x.tokens != y.tokens for c, d in zip(a, b, strict=True) for x, y in zip(c, d, strict=True)
    )


def test_turns_interleave_across_conversations() -> None:
    order = in_turn_order(conversations(TurnsWorkload(conversations=3, turns=2)))
    assert [(m.turn, m.conversation) for m in order] == [
        (1, 0),
        (1, 1),
        (1, 2),
        (2, 0),
        (2, 1),
        (2, 2),
    ]


def test_the_default_history_is_at_least_four_times_the_new_message_from_turn_3() -> None:
    w = TurnsWorkload()
    shortest_history = w.first_tokens + 2 * w.answer_tokens + w.short[0]
    assert shortest_history >= 4 * w.long[1]


@pytest.mark.parametrize(
    "bad, says",
    [
        ({"turns": 0}, "turns must be at least 1"),
        ({"short": (10, 5)}, "short must be"),
        ({"long_share": 1.5}, "long_share must be in"),
    ],
)
def test_bad_workloads_are_refused(bad: dict[str, object], says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        TurnsWorkload(**bad)  # type: ignore[arg-type]
