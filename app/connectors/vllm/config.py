"""The connector's settings, from ``kv_connector_extra_config``."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Literal

from app.connectors.vllm.pacing import DEFAULT_IDLE_POLL_S
from app.errors import ConfigError

# vLLM's kv_role -> the sidecar's role
Role = Literal["prefill", "decode", "both"]
_ROLES: dict[str, Role] = {"kv_producer": "prefill", "kv_consumer": "decode", "kv_both": "both"}
# How long a prefill keeps its blocks waiting for decode's target, unless told otherwise.
DEFAULT_TARGET_TIMEOUT_S = 30.0
# Replaced by the DP rank in "sidecar" and "target_url": each DP rank has an agent of its own.
DP_PLACEHOLDER = "{dp}"
# Replaced by the pipeline stage in the same two: each PP stage has an agent of its own.
PP_PLACEHOLDER = "{pp}"


def dp_identity(vllm_config: Any) -> tuple[int, str]:
    """This engine's DP rank and the suffix vLLM gave its engine id ("" without DP).

    vLLM's engine core appends ``_dp<rank>`` to ``kv_transfer_config.engine_id`` when data
    parallel is on, before any connector is built; ``data_parallel_index`` keeps the rank
    where a dense model's ``data_parallel_rank`` is reset to 0."""
    rank = int(getattr(vllm_config.parallel_config, "data_parallel_index", 0) or 0)
    suffix = f"_dp{rank}"
    engine_id = str(vllm_config.kv_transfer_config.engine_id or "")
    return rank, suffix if engine_id.endswith(suffix) else ""


def _per_rank(value: str, key: str, rank: int, data_parallel: bool) -> str:
    if DP_PLACEHOLDER in value:
        return value.replace(DP_PLACEHOLDER, str(rank))
    if data_parallel:
        raise ConfigError(
            f'data parallel: every DP rank would use kv_connector_extra_config "{key}" '
            f"{value!r}; put {DP_PLACEHOLDER} in it (e.g. ipc:///run/kvs/engine-dp{{dp}}.ipc), "
            "where each DP rank finds an agent of its own"
        )
    return value


def _per_stage(value: str, key: str, pp_size: int) -> str:
    if pp_size > 1 and PP_PLACEHOLDER not in value:
        raise ConfigError(
            f"pipeline parallel: every one of the {pp_size} stages would use "
            f'kv_connector_extra_config "{key}" {value!r}; put {PP_PLACEHOLDER} in it (e.g. '
            "ipc:///run/kvs/engine-pp{pp}.ipc), where each stage finds an agent of its own"
        )
    return value


def _idle_poll_s(extra: dict[str, Any]) -> float:
    ms = extra.get("idle_poll_interval_ms", DEFAULT_IDLE_POLL_S * 1e3)
    try:
        value = float(ms)
    except (TypeError, ValueError):
        value = -1.0
    if not 0 <= value <= 1000:
        raise ConfigError(
            f'kv_connector_extra_config "idle_poll_interval_ms": expected milliseconds from 0 '
            f"(every no-forward step asks the sidecar) to 1000, got {ms!r}"
        )
    return value / 1e3


@dataclass(frozen=True)
class ConnectorConfig:
    sidecar: str  # the sidecar's engine-link endpoint, e.g. ipc:///run/kvs/engine.ipc
    engine_id: str
    tp_size: int
    prefill_tp: int  # TP size of the prefill instances this decode instance receives from
    recv_timeout_s: float | None
    link_timeout_s: float
    # How long decode waits for a prefill to start a request (None: the sidecar's setting).
    recv_queue_timeout_s: float | None = None
    pool: bool = False  # load prefix hits from / store prompts into the sidecar's KV pool
    # Decode also stores what a request computed, its answer included, for the conversation's
    # next turn (``pool_save_answers``).
    save_answers: bool = False
    # While a request runs, store every k-th lcm block boundary it crosses (0: only when it
    # finishes, which a window or a Mamba state has mostly given back by then). On (1) by
    # default: decode's step time with it was no slower than without on a quiet host
    # (docs/benchmarks.md, "Running pool stores: cost"): ``pool_save_every``.
    save_every: int = 1
    # "sidecar": a container next to the engine; "in_process": the worker hosts the agent
    agent: str = "sidecar"
    role: Role = "both"  # the sidecar role of this instance (from vLLM's kv_role)
    # Prefill first (a router that is not kv-sidecar's proxy): where decode posts its target,
    # this instance's sidecar admin API (``http://host:port/v1/kv_targets``), named in prefill's
    # answer; and how long prefill keeps its blocks for it.
    target_url: str | None = None
    target_timeout_s: float = DEFAULT_TARGET_TIMEOUT_S
    # A speculative drafter's KV moves with the target's. False leaves it out, as connectors
    # that move only the target's layers do: decode's drafts then read blocks that prefill
    # never wrote (a diagnosis of what the draft's KV is worth; both sides must agree).
    transfer_draft_kv: bool = True
    # Pipeline parallel: each stage holds layers of its own and is an engine of its own
    # (``engine_id`` + ``_pp<stage>``, ``{pp}`` in ``sidecar`` and ``target_url``); decode's
    # stage k takes prefill's stage k's layers, so both run the same number of stages.
    pp_size: int = 1
    pp_stage: int | None = None  # set on a worker (``for_stage``); the scheduler spans them all
    # Steps without a forward pass ask the sidecar what finished at most this often (pacing.py).
    idle_poll_s: float = DEFAULT_IDLE_POLL_S
    data_parallel: bool = False  # one DP rank of several (``dp_identity``: vLLM's id suffix)

    def for_stage(self, stage: int) -> ConnectorConfig:
        """This config as seen by pipeline stage ``stage``'s workers (itself without PP)."""
        if self.pp_size == 1:
            return replace(self, pp_stage=0)
        return replace(
            self,
            sidecar=self.sidecar.replace(PP_PLACEHOLDER, str(stage)),
            engine_id=f"{self.engine_id}_pp{stage}",
            pp_stage=stage,
        )

    def stages(self) -> list[ConnectorConfig]:
        """One config per pipeline stage: the scheduler talks to every stage's agent."""
        return [self.for_stage(s) for s in range(self.pp_size)]

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
        parallel = vllm_config.parallel_config
        pp = int(getattr(parallel, "pipeline_parallel_size", 1))
        dp, suffix = dp_identity(vllm_config)
        tp = int(parallel.tensor_parallel_size)
        timeout = extra.get("recv_timeout_s")
        queue = extra.get("recv_queue_timeout_s")
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
        pool = bool(extra.get("pool", False))
        if pp > 1 and (pool or agent == "in_process"):
            raise ConfigError(
                f"pipeline_parallel_size is {pp}: each stage needs a kv-sidecar container of its "
                'own, and the KV pool stores whole prompts of one agent; set "pool": false and '
                '"agent": "sidecar" (or run pipeline_parallel_size 1)'
            )
        save_answers = bool(extra.get("pool_save_answers", False))
        if save_answers and not pool:
            raise ConfigError(
                '"pool_save_answers" stores decode\'s answers in the KV pool; set "pool": true '
                "as well (a Mooncake master and the pool on the sidecars)"
            )
        save_every = extra.get("pool_save_every", 1)
        if not isinstance(save_every, int) or isinstance(save_every, bool) or save_every < 0:
            raise ConfigError(
                f'"pool_save_every" is how many block boundaries a running request crosses '
                f"between its pool stores (0: only when it finishes); expected an integer >= 0, "
                f"got {save_every!r}"
            )
        target_url = str(extra["target_url"]) if extra.get("target_url") else None
        if target_url is not None:
            target_url = _per_stage(
                _per_rank(target_url, "target_url", dp, bool(suffix)), "target_url", pp
            )
        return cls(
            sidecar=_per_stage(_per_rank(str(sidecar), "sidecar", dp, bool(suffix)), "sidecar", pp),
            # The name given in the extra config gets vLLM's DP suffix too.
            engine_id=f"{extra['engine_id']}{suffix}" if extra.get("engine_id") else ktc.engine_id,
            tp_size=tp,
            prefill_tp=int(extra.get("prefill_tp", tp)),
            recv_timeout_s=None if timeout is None else float(timeout),
            recv_queue_timeout_s=None if queue is None else float(queue),
            link_timeout_s=float(extra.get("link_timeout_s", 10.0)),
            pool=pool,
            save_answers=save_answers,
            save_every=save_every,
            agent=agent,
            role=_ROLES.get(str(ktc.kv_role), "both"),
            target_url=target_url,
            target_timeout_s=float(extra.get("target_timeout_s", DEFAULT_TARGET_TIMEOUT_S)),
            transfer_draft_kv=bool(extra.get("transfer_draft_kv", True)),
            pp_size=pp,
            idle_poll_s=_idle_poll_s(extra),
            data_parallel=bool(suffix),
        )
