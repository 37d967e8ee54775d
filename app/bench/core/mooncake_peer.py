"""vLLM's own ``MooncakeConnector`` made to run on CPU-only torch, with timestamps for the bench.

vLLM loads this module through ``kv_connector_module_path`` (``kv_connector:
"BenchMooncakeConnector"``). Two things differ from the stock connector, nothing in its
transfer path:

- ``MooncakeConnectorWorker.__init__`` asks ``torch.accelerator.current_device_index()``, which
  raises when torch has no accelerator; while the connector is built it answers 0 (the value
  only feeds ``current_platform.set_device``, a no-op on CPU).
- The connector is built, and its KV caches registered, on a thread of its own
  (``core.cores.run_on_transfer_thread``): named ``kvs-mooncake`` and, with
  ``KVS_BENCH_TRANSFER_CPUS`` set (the dedicated-core regime), pinned to those CPUs. Every
  thread Mooncake's transfer engine and the connector start (sender pool, listener and receiver
  loops, bootstrap server) inherits both, so they run on the transfer core and their CPU time
  can be read per thread; built on the worker's own thread they would inherit its OpenMP
  binding to the compute core.
- With ``KVS_BENCH_EVENTS`` set, the connector appends one JSON line per event to that file:
  ``p_finished`` (P's scheduler ``request_finished``), ``sent`` (a sender finished writing a
  request's blocks: bytes, seconds, descriptors) and ``d_landed`` (D's receiver marked a request's
  KV complete). Times are ``time.time()``, comparable across processes on one host.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector import (
    MooncakeConnector,
    MooncakeConnectorWorker,
)

from app.bench.core.cores import run_on_transfer_thread

EVENTS_ENV = "KVS_BENCH_EVENTS"


def log_event(kind: str, **fields: Any) -> None:
    """Append one event line; a single O_APPEND write, so lines of several threads and
    processes never interleave."""
    path = os.environ.get(EVENTS_ENV)
    if not path:
        return
    line = json.dumps({"ev": kind, "t": time.time(), "pid": os.getpid(), **fields}) + "\n"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


class _LandingSet(set[str]):
    """D's set of requests whose KV is complete; stamps each request as it is added."""

    def add(self, element: str) -> None:
        log_event("d_landed", req=element)
        super().add(element)


class _StampedWorker(MooncakeConnectorWorker):
    """The stock worker; ``finished_recving_reqs`` stamps landings (the worker swaps in a fresh
    set after every poll, so the property wraps each one)."""

    @property
    def finished_recving_reqs(self) -> set[str]:
        return self.__dict__["_kvs_landing"]

    @finished_recving_reqs.setter
    def finished_recving_reqs(self, value: Iterable[str]) -> None:
        self.__dict__["_kvs_landing"] = _LandingSet(value)


def _stamp_sends(worker: MooncakeConnectorWorker) -> None:
    record = worker.xfer_stats.record_transfer

    def stamped(duration_s: float, total_bytes: int, num_descs: int) -> None:
        log_event("sent", seconds=duration_s, bytes=total_bytes, descriptors=num_descs)
        record(duration_s, total_bytes, num_descs)

    worker.xfer_stats.record_transfer = stamped  # type: ignore[method-assign]


class BenchMooncakeConnector(MooncakeConnector):
    """``MooncakeConnector`` on CPU-only torch, its hand-offs stamped for ``bench pd``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        accel = torch.accelerator
        original = accel.current_device_index
        if not accel.is_available():
            accel.current_device_index = lambda: 0
        try:
            run_on_transfer_thread(
                lambda: super(BenchMooncakeConnector, self).__init__(*args, **kwargs)
            )
        finally:
            accel.current_device_index = original
        worker = self.connector_worker
        if worker is not None and os.environ.get(EVENTS_ENV):
            landed = set(worker.__dict__.pop("finished_recving_reqs", ()))
            worker.__class__ = _StampedWorker
            worker.finished_recving_reqs = landed
            _stamp_sends(worker)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        # Mooncake registers the memory here; any thread it starts for that goes with the rest.
        run_on_transfer_thread(
            lambda: super(BenchMooncakeConnector, self).register_kv_caches(kv_caches)
        )

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        _stamp_finished(request)
        return super().request_finished(request, block_ids)

    def request_finished_all_groups(
        self, request: Any, block_ids: Any
    ) -> tuple[bool, dict[str, Any] | None]:
        # The hybrid allocator's entry point (SupportsHMA); the other one without it.
        _stamp_finished(request)
        return super().request_finished_all_groups(request, block_ids)


def _stamp_finished(request: Any) -> None:
    params = request.kv_transfer_params or {}
    if params.get("do_remote_decode"):
        log_event("p_finished", req=request.request_id, transfer_id=params.get("transfer_id"))
