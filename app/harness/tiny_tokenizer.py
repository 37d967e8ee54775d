"""A real tokenizer and chat template for the tiny models (issue 53, item 4), so that engines can
serve ``/v1/chat/completions`` and ``/tokenize``.

One word per token id: ``<unk>`` (0), the template's role markers (1-4), then ``w5`` ...
``w1023``, split on whitespace and joined with single spaces (tokenizers' WordLevel model).
Every id survives ids -> text -> ids, so an answer sent back as the next turn's assistant message
renders to the very ids the engine generated: a random model's output cannot cut a
conversation's prefix hit for reasons of its own. No token is special, since vLLM drops special
tokens from an answer's text, which would break that round trip.

Engines keep ``--skip-tokenizer-init`` unless their model folder holds a tokenizer
(``has_tokenizer``; engines.vllm_command): the tests that write one and ``bench turns --api chat``
start engines with it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

UNK = "<unk>"
ROLES = ("system", "user", "assistant")
_MARKERS = (UNK, *(f"<|{r}|>" for r in ROLES), "<|end|>")
# Each message as its role marker, its words and the end marker, space separated.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
FIRST_WORD = len(_MARKERS)  # the first id a message's words may use


def token_text(i: int) -> str:
    """The word of id ``i``."""
    return _MARKERS[i] if i < FIRST_WORD else f"w{i}"


def words(ids: Iterable[int]) -> str:
    """Message text that renders to ``ids``."""
    return " ".join(token_text(i) for i in ids)


def has_tokenizer(model: Path) -> bool:
    return (model / "tokenizer.json").exists() and (model / "tokenizer_config.json").exists()


def write_tiny_tokenizer(model: Path) -> Path:
    """``tokenizer.json`` and ``tokenizer_config.json`` (with ``CHAT_TEMPLATE``) beside the
    tiny model in ``model`` (idempotent), over its ``vocab_size``."""
    if has_tokenizer(model):
        return model
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    model_config = json.loads((model / "config.json").read_text())
    vocab_size = int(model_config["vocab_size"])
    vocab = {token_text(i): i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # Joins words with one space (no "##" word pieces here; no clean-up of punctuation).
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tok.save(str(model / "tokenizer.json.tmp"))
    # No "unk_token" here: transformers would make <unk> (id 0) special, and vLLM, skipping
    # special tokens in an answer's text by default, would drop it from an answer sent back.
    # The WordLevel model still maps unknown words to it.
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": int(model_config["max_position_embeddings"]),
        "chat_template": CHAT_TEMPLATE,
    }
    (model / "tokenizer_config.json.tmp").write_text(json.dumps(config))
    os.replace(model / "tokenizer.json.tmp", model / "tokenizer.json")
    os.replace(model / "tokenizer_config.json.tmp", model / "tokenizer_config.json")
    return model
