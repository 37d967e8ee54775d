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
    # A DP rank's no-forward steps skip their round trip instead of sleeping (pacing.py).
    assert all(c.data_parallel for c in (*ranks, plain))
    assert not ConnectorConfig.from_vllm(vllm_config(sidecar=extra["sidecar"])).data_parallel


def test_dp_ranks_sharing_one_sidecar_endpoint_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"put \{dp\} in it"):
        ConnectorConfig.from_vllm(vllm_config(1))


def test_without_dp_nothing_is_suffixed() -> None:
    c = ConnectorConfig.from_vllm(vllm_config(engine_id="decode"))
    assert (c.engine_id, c.sidecar) == ("decode", "ipc:///run/kvs/engine.ipc")


def test_each_pp_stage_is_an_engine_with_a_sidecar_of_its_own() -> None:
    extra = {
        "sidecar": "ipc:///run/kvs/engine-pp{pp}.ipc",
        "engine_id": "prefill",
        "target_url": "http://kvs-pp{pp}:8080/v1/kv_targets",
    }
    c = ConnectorConfig.from_vllm(vllm_config(pp=2, **extra))
    stages = c.stages()
    assert [s.engine_id for s in stages] == ["prefill_pp0", "prefill_pp1"]
    assert [s.sidecar for s in stages] == [
        "ipc:///run/kvs/engine-pp0.ipc",
        "ipc:///run/kvs/engine-pp1.ipc",
    ]
    assert [s.pp_stage for s in stages] == [0, 1]
    # Decode's stage k fills in its own number when it posts (prefill first): kept as given.
    assert {s.target_url for s in stages} == {extra["target_url"]}


def test_pp_stages_sharing_one_endpoint_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"2 stages would use .*\"sidecar\".*put \{pp\} in"):
        ConnectorConfig.from_vllm(vllm_config(pp=2))
    with pytest.raises(ConfigError, match=r"\"target_url\".*put \{pp\} in"):
        ConnectorConfig.from_vllm(
            vllm_config(pp=2, sidecar="ipc:///k-{pp}.ipc", target_url="http://kvs/v1/kv_targets")
        )


def test_pp_with_the_pool_is_refused_with_the_reason() -> None:
    with pytest.raises(ConfigError, match=r"pipeline_parallel_size is 2.*\"pool\": false"):
        ConnectorConfig.from_vllm(vllm_config(pp=2, sidecar="ipc:///k-{pp}.ipc", pool=True))


def test_without_pp_a_stage_is_the_engine_itself() -> None:
    c = ConnectorConfig.from_vllm(vllm_config(engine_id="decode"))
    assert [(s.engine_id, s.sidecar) for s in c.stages()] == [
        ("decode", "ipc:///run/kvs/engine.ipc")
    ]
