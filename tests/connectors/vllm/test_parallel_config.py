"""The connector's identity under data and pipeline parallel, from vLLM's own config objects.

vLLM's engine core suffixes ``kv_transfer_config.engine_id`` with ``_dp<rank>`` and sets
``data_parallel_index`` before it builds any connector; these tests hand the connector that
state (the real engine runs are in test_data_parallel.py).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from vllm.config import KVTransferConfig

from app.connectors.vllm.config import ConnectorConfig
from app.errors import ConfigError


def vllm_config(dp_rank: int | None = None, pp: int = 1, **extra: Any) -> SimpleNamespace:
    transfer = KVTransferConfig(
        kv_connector="KVSidecarConnector",
        kv_role="kv_producer",
        engine_id="base",
        kv_connector_extra_config={"sidecar": "ipc:///run/kvs/engine.ipc", **extra},
    )
    if dp_rank is not None:  # what vLLM's run_engine_core does with data parallel on
        transfer.engine_id = f"base_dp{dp_rank}"
    parallel = SimpleNamespace(
        tensor_parallel_size=1,
        pipeline_parallel_size=pp,
        data_parallel_index=dp_rank or 0,
    )
    return SimpleNamespace(kv_transfer_config=transfer, parallel_config=parallel)


def test_each_dp_rank_is_an_engine_with_a_sidecar_of_its_own() -> None:
    extra = {"sidecar": "ipc:///run/kvs/engine-dp{dp}.ipc", "engine_id": "prefill"}
    ranks = [ConnectorConfig.from_vllm(vllm_config(r, **extra)) for r in (0, 1)]
    assert [c.engine_id for c in ranks] == ["prefill_dp0", "prefill_dp1"]
    assert [c.sidecar for c in ranks] == [
        "ipc:///run/kvs/engine-dp0.ipc",
        "ipc:///run/kvs/engine-dp1.ipc",
    ]
    # Without an engine_id of its own, vLLM's (already suffixed) one.
    plain = ConnectorConfig.from_vllm(vllm_config(1, sidecar=extra["sidecar"]))
    assert plain.engine_id == "base_dp1"


def test_dp_ranks_sharing_one_sidecar_endpoint_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"put \{dp\} in it"):
        ConnectorConfig.from_vllm(vllm_config(1))


def test_without_dp_nothing_is_suffixed() -> None:
    c = ConnectorConfig.from_vllm(vllm_config(engine_id="decode"))
    assert (c.engine_id, c.sidecar) == ("decode", "ipc:///run/kvs/engine.ipc")


def test_pipeline_parallel_is_refused_with_the_reason() -> None:
    with pytest.raises(ConfigError, match=r"pipeline_parallel_size is 2.*TP rank 0"):
        ConnectorConfig.from_vllm(vllm_config(pp=2))
