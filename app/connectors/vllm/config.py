"""The connector's settings, from ``kv_connector_extra_config``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from app.errors import ConfigError


@dataclass(frozen=True)
class ConnectorConfig:
    sidecar: str  # the sidecar's engine-link endpoint, e.g. ipc:///run/kvs/engine.ipc
    engine_id: str
    tp_size: int
    prefill_tp: int  # TP size of the prefill instances this decode instance receives from
    recv_timeout_s: float | None
    link_timeout_s: float
    pool: bool = False  # load prefix hits from / store prompts into the sidecar's KV pool

    @classmethod
    def from_vllm(cls, vllm_config: Any) -> ConnectorConfig:
        ktc = vllm_config.kv_transfer_config
        extra = dict(ktc.kv_connector_extra_config or {})
        sidecar = extra.get("sidecar")
        if not sidecar:
            raise ConfigError(
                'kv_connector_extra_config needs "sidecar": the engine-link endpoint of the '
                'kv-sidecar next to this engine, e.g. "ipc:///run/kvs/engine.ipc"'
            )
        tp = int(vllm_config.parallel_config.tensor_parallel_size)
        timeout = extra.get("recv_timeout_s")
        return cls(
            sidecar=str(sidecar),
            engine_id=str(extra.get("engine_id") or ktc.engine_id),
            tp_size=tp,
            prefill_tp=int(extra.get("prefill_tp", tp)),
            recv_timeout_s=None if timeout is None else float(timeout),
            link_timeout_s=float(extra.get("link_timeout_s", 10.0)),
            pool=bool(extra.get("pool", False)),
        )
