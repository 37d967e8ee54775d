"""``bench turns --api chat``'s messages (``turns.chat``): each message's words survive
text -> ids -> text through the tiny models' real tokenizer, the next turn's messages carry the
answer back, and the chat template renders turn 2 as turn 1's prompt, its answer, the new
message and 4 marker tokens, which the rows count and check."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerFast

from app.bench.turns.chat import answered, prefix_kept, template_tokens, user_turn
from app.bench.turns.workload import TurnsWorkload, conversations, in_turn_order
from app.harness.tiny_tokenizer import words, write_tiny_tokenizer

W = TurnsWorkload(conversations=3, turns=3, first_tokens=200, seed=5)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny tokenizer beside a tiny model's config (its vocabulary, its length)."""
    root = tmp_path_factory.mktemp("tok")
    (root / "config.json").write_text(
        json.dumps({"vocab_size": 1024, "max_position_embeddings": 4096})
    )
    return write_tiny_tokenizer(root)


def test_every_message_survives_text_to_ids_to_text(model: Path) -> None:
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    messages = in_turn_order(conversations(W))
    assert [m.tokens for m in messages] == [m.tokens for m in in_turn_order(conversations(W))]
    for m in messages:
        text = user_turn([], m)[0]["content"]
        ids = tok.encode(text).ids
        assert ids == list(m.tokens), (m.conversation, m.turn)
        assert tok.decode(ids) == text


def test_the_next_turn_carries_the_history_and_the_answer(model: Path) -> None:
    first, second, _ = conversations(W)[0]
    sent = user_turn([], first)
    assert sent == [{"role": "user", "content": words(first.tokens)}]
    after = answered(sent, "w7 w8")
    assert sent == [{"role": "user", "content": words(first.tokens)}], "sent is not changed"
    assert [m["role"] for m in user_turn(after, second)] == ["user", "assistant", "user"]
    assert user_turn(after, second)[1:] == [
        {"role": "assistant", "content": "w7 w8"},
        {"role": "user", "content": words(second.tokens)},
    ]


def render(tok: PreTrainedTokenizerFast, messages: list[dict[str, str]]) -> list[int]:
    """The template's text, then the tokenizer: what the engine's chat path does."""
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert isinstance(text, str)
    return list(tok.encode(text, add_special_tokens=False))


def test_the_template_keeps_the_answer_and_adds_four_markers_a_turn(model: Path) -> None:
    tok = PreTrainedTokenizerFast.from_pretrained(str(model))
    first, second = conversations(W)[1][:2]
    answer = [3, 11, 500, 1023, 4, 0]  # markers and <unk> too: no token is special
    sent = user_turn([], first)
    one = render(tok, sent)
    row: dict[str, Any] = {"prompt_tokens": len(one), "prompt_ids": one, "answer": answer}
    assert template_tokens(len(one), len(first.tokens), None) == 3
    # As vLLM writes an answer's text: special tokens skipped (there are none).
    assert tok.all_special_ids == []
    text = tok.decode(answer, skip_special_tokens=True)
    sent = user_turn(answered(sent, text), second)
    two = render(tok, sent)
    assert two[: len(one) + len(answer)] == one + answer
    assert template_tokens(len(two), len(second.tokens), row) == 4
    assert prefix_kept(two, row) is True
    assert prefix_kept(two, None) is None and prefix_kept(None, row) is None
    # An answer that came back otherwise (a word dropped) is seen.
    other = user_turn(answered(user_turn([], first), tok.decode(answer[:-1])), second)
    assert prefix_kept(render(tok, other), row) is False
    assert template_tokens(len(render(tok, other)), len(second.tokens), row) == 3
