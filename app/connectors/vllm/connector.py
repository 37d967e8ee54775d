"""``KVSidecarConnector``: vLLM's connector API mapped onto a kv-sidecar (DESIGN §2b).

One class, two roles as vLLM instantiates it: in the scheduler process it delegates to
``SchedulerSide``, in each worker to ``WorkerSide``. Targets vLLM 0.32-0.33's ``kv_connector/v1``.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)

from app.connectors.vllm.config import ConnectorConfig
from app.connectors.vllm.metadata import KVSidecarMetadata
from app.connectors.vllm.scheduler import SchedulerSide
from app.connectors.vllm.stats import KVSidecarPromMetrics, KVSidecarStats
from app.connectors.vllm.worker import WorkerSide

log = logging.getLogger(__name__)


class KVSidecarConnector(KVConnectorBase_V1, SupportsHMA):
    """Decode-first, layer-wise push of KV through the kv-sidecar next to each engine."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config, role, kv_cache_config)
        config = ConnectorConfig.from_vllm(vllm_config)
        self.scheduler: SchedulerSide | None = None
        self.worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler = SchedulerSide(config, kv_cache_config)
            if getattr(self._kv_transfer_config, "kv_load_failure_policy", "") == "fail":
                log.warning(
                    "kv_load_failure_policy is 'fail': a request whose KV transfer fails ends "
                    "with an error; set it to 'recompute' to have decode recompute it instead"
                )
        else:
            from vllm.distributed.parallel_state import (
                get_pp_group,
                get_tensor_model_parallel_rank,
            )

            rank = get_tensor_model_parallel_rank() if config.tp_size > 1 else 0
            stage = get_pp_group().rank_in_group if config.pp_size > 1 else 0
            self.worker = WorkerSide(config.for_stage(stage), rank, vllm_config, kv_cache_config)

    # ---- worker ----------------------------------------------------------------------------

    def _w(self) -> WorkerSide:
        assert self.worker is not None, "worker hook called on the scheduler connector"
        return self.worker

    def _meta(self) -> KVSidecarMetadata | None:
        meta = self._connector_metadata
        return meta if isinstance(meta, KVSidecarMetadata) else None

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self._w().register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        # The step begins here: every vLLM model runner calls this before the forward pass,
        # while 0.32+ calls start_load_kv after it unless the step has synchronous loads.
        super().bind_connector_metadata(connector_metadata)
        meta = self._meta()
        if meta is not None and self.worker is not None:
            self.worker.begin_step(meta)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return  # push: nothing to start; pool loads run after the forward (wait_for_save)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # push: the prefill wrote these layers before the request was scheduled

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        self._w().save_kv_layer(layer_name)

    def wait_for_save(self) -> None:
        self._w().wait_for_save(self._meta())

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        sending, recving, failed = self._w().get_finished(finished_req_ids)
        return KVConnectorTransferResults(sending, recving, failed)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self.worker.pool_saves_done() if self.worker is not None else None

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        # Workers only: the scheduler side moves no bytes (its refused loads reach the workers
        # as failed_recvs and are counted there).
        return self.worker.stats.take() if self.worker is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats:
        return KVSidecarStats(data=data) if data is not None else KVSidecarStats()

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics:
        return KVSidecarPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        for side in (self.worker, self.scheduler):
            if side is not None:
                side.close()

    # ---- scheduler -------------------------------------------------------------------------

    def _s(self) -> SchedulerSide:
        assert self.scheduler is not None, "scheduler hook called on a worker connector"
        return self.scheduler

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self._s().get_num_new_matched_tokens(request, num_computed_tokens)

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self._s().pool.bind(kv_cache_manager)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._s().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return self._s().build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        self._s().update_connector_output(connector_output)

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._s().request_finished(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._s().request_finished(request, block_ids)

    def has_pending_push_work(self) -> bool:
        return self.scheduler is not None and self.scheduler.has_pending_push_work()
