"""``pool_save_answers`` (issue 37): decode stores a finished request's answer in the pool only
with the pool on; without it the setting is refused, saying what to set. Which prefix of an
answer a hybrid model stores is the store's held-blocks rule (tests/store/test_held_blocks.py)
and is checked on the engines (test_pool_window.py)."""

from __future__ import annotations

import pytest

from app.connectors.vllm.config import ConnectorConfig
from app.errors import ConfigError
from tests.connectors.vllm.test_parallel_config import vllm_config


def test_saving_answers_without_the_pool_is_refused() -> None:
    with pytest.raises(ConfigError, match=r'"pool_save_answers".*set "pool": true'):
        ConnectorConfig.from_vllm(vllm_config(pool_save_answers=True))


def test_answers_are_saved_only_when_asked() -> None:
    assert ConnectorConfig.from_vllm(vllm_config(pool=True, pool_save_answers=True)).save_answers
    assert not ConnectorConfig.from_vllm(vllm_config(pool=True)).save_answers


def test_running_stores_are_on_by_default_and_can_be_turned_off() -> None:
    """``pool_save_every`` defaults to 1 (issue 54: its step time was measured on a quiet
    host, docs/benchmarks.md); 0 keeps the store at the end only; anything else is refused."""
    assert ConnectorConfig.from_vllm(vllm_config(pool=True)).save_every == 1
    assert ConnectorConfig.from_vllm(vllm_config(pool=True, pool_save_every=0)).save_every == 0
    with pytest.raises(ConfigError, match=r'"pool_save_every".*integer >= 0'):
        ConnectorConfig.from_vllm(vllm_config(pool=True, pool_save_every=-1))
