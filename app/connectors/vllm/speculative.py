"""Speculative decoding as the connector sees it: which layers are the draft's, and the
settings both sides of a transfer must share.

vLLM registers a drafter's attention layers with the connector next to the target's: a
``draft_model`` drafter as ``draft_model.model.layers.<i>``, an EAGLE/MTP head as
``model.layers.<n>`` with ``n`` past the target's last layer. With speculative decoding on, the
model runner calls ``wait_for_save`` only after the drafter ran (``defer_kv_connector_finalize``
in its ``execute_model``); a draft layer is written once per draft pass, so only then is it
final for the step.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from vllm.model_executor.models.utils import extract_layer_index

# The drafter vLLM builds for the ``draft_model`` method lives under this attribute.
DRAFT_MODEL_PREFIX = "draft_model."


def speculative_identity(vllm_config: Any) -> str:
    """What a peer's speculative settings must equal, readable in an error ("" when off):
    the method, the draft as configured, and the number of speculative tokens."""
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is None:
        return ""
    return (
        f"method={spec.method} draft={spec.model or '-'} "
        f"num_speculative_tokens={spec.num_speculative_tokens}"
    )


def target_layer_count(vllm_config: Any) -> int:
    """How many decoder layers the target model has (its config, not its KV layers)."""
    return int(vllm_config.model_config.hf_text_config.num_hidden_layers)


def draft_layers(names: Iterable[str], vllm_config: Any) -> frozenset[str]:
    """The layers among ``names`` that belong to the drafter (none without speculative
    decoding): under ``draft_model.``, or numbered past the target's layers."""
    if getattr(vllm_config, "speculative_config", None) is None:
        return frozenset()
    count = target_layer_count(vllm_config)
    return frozenset(
        n for n in names if n.startswith(DRAFT_MODEL_PREFIX) or extract_layer_index(n) >= count
    )


def draft_kv_heads(vllm_config: Any) -> int | None:
    """The drafter's own KV head count (whole model, before TP), where it has a config."""
    spec = getattr(vllm_config, "speculative_config", None)
    draft = getattr(spec, "draft_model_config", None)
    return None if draft is None else int(draft.get_total_num_kv_heads())


def eagle_groups(vllm_config: Any, kv_cache_config: Any) -> list[int]:
    """The KV cache groups whose last matched block vLLM's prefix cache drops (EAGLE/MTP's
    block drop, ``use_eagle_block_drop``): the groups vLLM flags, else every group, as its
    coordinator falls back; none without it."""
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is None or not spec.use_eagle_block_drop():
        return []
    groups = kv_cache_config.kv_cache_groups
    flagged = [i for i, g in enumerate(groups) if getattr(g, "is_eagle_group", False)]
    return flagged or list(range(len(groups)))
