"""The connector's settings, from ``kv_connector_extra_config``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from app.errors import ConfigError

# vLLM's kv_role -> the sidecar's role
Role = Literal["prefill", "decode", "both"]
_ROLES: dict[str, Role] = {"kv_producer": "prefill", "kv_consumer": "decode", "kv_both": "both"}
# How long a prefill keeps its blocks waiting for decode's target, unless told otherwise.
DEFAULT_TARGET_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class ConnectorConfig:
    sidecar: str  # the sidecar's engine-link endpoint, e.g. ipc:///run/kvs/engine.ipc
    engine_id: str
    tp_size: int
    prefill_tp: int  # TP size of the prefill instances this decode instance receives from
    recv_timeout_s: float | None
    link_timeout_s: float
    pool: bool = False  # load prefix hits from / store prompts into the sidecar's KV pool
    # "sidecar": a container next to the engine; "in_process": the worker hosts the agent
    agent: str = "sidecar"
    role: Role = "both"  # the sidecar role of this instance (from vLLM's kv_role)
    # Prefill first (a router that is not kv-sidecar's proxy): where decode posts its target,
    # this instance's sidecar admin API (``http://host:port/v1/kv_targets``), named in prefill's
    # answer; and how long prefill keeps its blocks for it.
    target_url: str | None = None
    target_timeout_s: float = DEFAULT_TARGET_TIMEOUT_S

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
        agent = str(extra.get("agent", "sidecar"))
        if agent not in ("sidecar", "in_process"):
            raise ConfigError(
                f'kv_connector_extra_config "agent" is {agent!r}; expected "sidecar" (a '
                'kv-sidecar container next to the engine) or "in_process" (the worker hosts it)'
            )
        if agent == "in_process" and tp != 1:
            raise ConfigError(
                f'"agent": "in_process" hosts one rank\'s agent in each worker, but peers expect '
                f"one agent for all {tp} ranks of an instance; run the kv-sidecar container, "
                "or tensor_parallel_size 1"
            )
        return cls(
            sidecar=str(sidecar),
            engine_id=str(extra.get("engine_id") or ktc.engine_id),
            tp_size=tp,
            prefill_tp=int(extra.get("prefill_tp", tp)),
            recv_timeout_s=None if timeout is None else float(timeout),
            link_timeout_s=float(extra.get("link_timeout_s", 10.0)),
            pool=bool(extra.get("pool", False)),
            agent=agent,
            role=_ROLES.get(str(ktc.kv_role), "both"),
            target_url=str(extra["target_url"]) if extra.get("target_url") else None,
            target_timeout_s=float(extra.get("target_timeout_s", DEFAULT_TARGET_TIMEOUT_S)),
        )
