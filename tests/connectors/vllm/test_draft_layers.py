"""Which registered layers are a drafter's: the names vLLM gives them (its model runner loads a
``draft_model`` drafter under ``draft_model.``, an EAGLE/MTP head numbered past the target)."""

from __future__ import annotations

from types import SimpleNamespace

from app.connectors.vllm.speculative import draft_layers, speculative_identity

TARGET = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]


def config(spec: object | None) -> SimpleNamespace:
    hf = SimpleNamespace(num_hidden_layers=2)
    return SimpleNamespace(speculative_config=spec, model_config=SimpleNamespace(hf_text_config=hf))


def spec(method: str, tokens: int = 3) -> SimpleNamespace:
    return SimpleNamespace(method=method, model="/models/draft", num_speculative_tokens=tokens)


def test_draft_model_layers_are_named_under_the_drafter() -> None:
    names = [*TARGET, "draft_model.model.layers.0.self_attn.attn"]
    assert draft_layers(names, config(spec("draft_model"))) == {names[2]}


def test_an_eagle_head_is_numbered_after_the_target() -> None:
    names = [*TARGET, "model.layers.2.self_attn.attn"]
    assert draft_layers(names, config(spec("eagle"))) == {names[2]}


def test_without_speculative_decoding_no_layer_is_a_draft() -> None:
    names = [*TARGET, "model.layers.2.self_attn.attn"]
    assert draft_layers(names, config(None)) == frozenset()
    assert speculative_identity(config(None)) == ""


def test_the_identity_names_method_draft_and_tokens() -> None:
    a, b = (speculative_identity(config(spec("draft_model", n))) for n in (3, 2))
    assert a != b
    assert a == "method=draft_model draft=/models/draft num_speculative_tokens=3"
