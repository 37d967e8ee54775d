"""``bench chat-keys`` finds where a chat template parts the next turn from what decode
stored, on a byte-level BPE tokenizer trained here and three templates written here: ChatML
(answers come back as they were generated), one that drops an earlier answer's reasoning (as
Qwen3's does) and one that trims content (as Gemma's does)."""

from __future__ import annotations

from typing import Any

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from app.bench.chat_keys.bench import proxy_share, shared_prefix, turn_keys

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# An earlier answer keeps only what follows its reasoning block.
DROPS_REASONING = CHATML.replace(
    "{{ m.content }}", "{{ m.content.split('</think>')[-1].lstrip('\\n') }}"
)
TRIMS = CHATML.replace("{{ m.content }}", "{{ m.content | trim }}")
TEXT = "the pool keeps each block of the prompt and the answer so the next turn loads them " * 4
HISTORY = [{"role": "user", "content": "what does the pool keep between two turns of a chat"}]
ANSWER = "it keeps the prompt and the answer, block by block, for the next turn"


def tokenizer(template: str) -> Any:
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    specials = ["<|im_start|>", "<|im_end|>", "<think>", "</think>"]
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator([TEXT, ANSWER, HISTORY[0]["content"]], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, chat_template=template)


def ids(tok: Any, text: str) -> list[int]:
    return list(tok(text, add_special_tokens=False)["input_ids"])


def test_an_answer_the_template_writes_back_as_generated_is_shared_whole() -> None:
    tok = tokenizer(CHATML)
    keys = turn_keys(tok, HISTORY, ANSWER, "and then?", proxy_block=4)
    assert keys.parted_at is None
    assert keys.answer_tokens == len(ids(tok, ANSWER)) > 0
    assert keys.answer_shared == keys.answer_tokens
    # Blocks past the previous prompt: the pool serves the answer's full ones.
    for b, gained in keys.gained_blocks.items():
        assert gained == (keys.prompt_tokens + keys.answer_tokens) // b - keys.prompt_tokens // b


def test_a_dropped_reasoning_block_parts_the_turns_at_the_answer() -> None:
    tok = tokenizer(DROPS_REASONING)
    keys = turn_keys(tok, HISTORY, ANSWER, "and then?", reasoning="first I think")
    assert keys.parted_at == 0
    assert keys.answer_shared == 0
    assert all(g == 0 for g in keys.gained_blocks.values())
    assert "<think>" in keys.parted


def test_trimmed_content_parts_the_turns_where_the_trim_is() -> None:
    tok = tokenizer(TRIMS)
    answer = ANSWER + "\n\n"  # the model ended with blank lines; the template trims them
    keys = turn_keys(tok, HISTORY, answer, "and then?")
    assert keys.parted_at == len(ids(tok, ANSWER))
    assert keys.answer_shared == len(ids(tok, ANSWER)) < keys.answer_tokens


@pytest.mark.parametrize(
    ("a", "b", "n"), [([1, 2, 3], [1, 2, 4], 2), ([1], [1, 2], 1), ([], [1], 0)]
)
def test_shared_prefix(a: list[int], b: list[int], n: int) -> None:
    assert shared_prefix(a, b) == n


def test_the_proxy_credits_the_routed_messages_not_the_answer() -> None:
    served = [{"role": "user", "content": TEXT}]
    later = [*served, {"role": "assistant", "content": TEXT}, {"role": "user", "content": "ok"}]
    share = proxy_share(served, later, block=4)
    # The routed user message is about half the later text; the answer was never routed.
    assert 0.3 < share < 0.6
