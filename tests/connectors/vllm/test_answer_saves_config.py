"""Which engines store a finished request's answer in the pool (``pool_save_answers``, issue
37): only with the pool on, and only where every KV cache group is plain full attention; a
hybrid model says in the log that it stores prompts alone. vLLM's own spec classes."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

from app.connectors.vllm.config import ConnectorConfig
from app.connectors.vllm.scheduler import SchedulerSide
from app.errors import ConfigError
from tests.connectors.vllm.test_parallel_config import vllm_config


def groups(*specs: object) -> SimpleNamespace:
    return SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=s) for s in specs])


def full() -> FullAttentionSpec:
    return FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)


def window() -> SlidingWindowSpec:
    return SlidingWindowSpec(
        block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16, sliding_window=128
    )


def test_saving_answers_without_the_pool_is_refused() -> None:
    with pytest.raises(ConfigError, match=r'"pool_save_answers".*set "pool": true'):
        ConnectorConfig.from_vllm(vllm_config(pool_save_answers=True))


def test_a_full_attention_model_stores_answers() -> None:
    config = ConnectorConfig.from_vllm(vllm_config(pool=True, pool_save_answers=True))
    assert config.save_answers
    assert SchedulerSide(config, groups(full(), full())).save_answers
    off = ConnectorConfig.from_vllm(vllm_config(pool=True))
    assert not SchedulerSide(off, groups(full())).save_answers


def test_a_hybrid_model_stores_prompts_alone_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    config = ConnectorConfig.from_vllm(vllm_config(pool=True, pool_save_answers=True))
    with caplog.at_level(logging.ERROR):
        side = SchedulerSide(config, groups(full(), window()))
    assert not side.save_answers
    assert "SlidingWindowSpec groups: answers are not stored" in caplog.text
