"""The stream thread: one per device, it waits for each layer's event, plans the layer for
every request of the step and writes it to each peer in turn, off the asyncio loop (Mooncake's
synchronous calls spin a core)."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from app.devices import Event
from app.devices.events import Gate
from app.errors import DeadlineExceeded, KVSidecarError, TransferError
from app.transfer.planning.planner import Descriptors, PairPlanner, StepRequest

log = logging.getLogger(__name__)

# ``LayerReady.layer`` meaning every layer of the step at once (bulk send after the forward pass,
# vLLM's ``wait_for_save``): one submission, runs merged across layers.
ALL_LAYERS = -1


@dataclass(frozen=True)
class Batch:
    """One peer's share of a layer task."""

    endpoint: str
    session: str  # the peer's Mooncake session
    planner: PairPlanner
    steps: list[StepRequest]


@dataclass
class LayerTask:
    """One ``LayerReady``: nothing of it is written before ``event.synchronize()`` returned;
    ``release`` (the event ring's slot) is called once the task ended, however it ended."""

    step: int
    layer: int
    event: Event
    batches: list[Batch]
    enqueued: float = field(default_factory=time.monotonic)
    release: Callable[[], None] | None = None
    gate: Gate | None = None  # opened once ``event`` completed: a backlog waits on it


@dataclass
class LayerResult:
    step: int
    layer: int
    group: int
    ok: list[str]
    failed: dict[str, str]
    req_bytes: dict[tuple[str, int], int]  # (request, D rank) -> bytes written
    bytes: int
    descriptors: int
    blocks: int
    latency_s: float
    started: float = 0.0  # monotonic time the write was submitted (0: nothing was written)


Writer = Callable[[str, np.ndarray, np.ndarray, np.ndarray], None]


class StreamThread:
    """One per device: waits for each layer's event, plans it, writes to each peer in turn."""

    def __init__(
        self,
        name: str,
        depth: int,
        writer: Writer,
        on_result: Callable[[LayerResult], None],
        pin: Callable[[str, Sequence[str]], list[str]],
        unpin: Callable[[Sequence[str]], None],
    ) -> None:
        """``pin(endpoint, ids)`` returns the ids that may be written now (live requests to a
        peer whose lease holds), counted in flight until ``unpin``."""
        self.queue: queue.Queue[LayerTask | None] = queue.Queue(maxsize=depth)
        self._writer, self._on_result, self._pin, self._unpin = writer, on_result, pin, unpin
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def put(self, task: LayerTask, timeout: float) -> None:
        """Blocks while the queue is full (back-pressure on the engine), up to ``timeout``."""
        try:
            self.queue.put(task, timeout=timeout)
        except queue.Full:
            raise DeadlineExceeded(
                f"stream queue full for {timeout}s: transfers are slower than the forward pass"
            ) from None

    def stop(self, timeout: float = 5.0) -> None:
        self.queue.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        while (task := self.queue.get()) is not None:
            try:
                self._run_task(task)
            except Exception:  # the thread must outlive any one bad task
                log.exception("stream thread failed on step %s layer %s", task.step, task.layer)
            finally:
                if task.release is not None:
                    try:
                        task.release()
                    except Exception:
                        log.exception(
                            "releasing the event of step %s layer %s", task.step, task.layer
                        )

    def _run_task(self, task: LayerTask) -> None:
        if not task.batches and task.gate is None:
            return  # nothing to write: no need to wait for the event
        try:
            task.event.synchronize()
        except Exception as e:  # a deadline, a refused slot, or the device's own error
            # Never write before the event completed: the layer's requests fail instead.
            why = str(e) if isinstance(e, KVSidecarError) else f"layer {task.layer}'s event: {e}"
            if task.gate is not None:
                task.gate.open(why)
            self._fail(task, why)
            return
        if task.gate is not None:
            task.gate.open()
        for batch in task.batches:
            self._submit(task, batch)

    def _fail(self, task: LayerTask, error: str) -> None:
        """Report every request of ``task`` failed with ``error``, nothing written."""
        for batch in task.batches:
            places = batch.planner.local.placements
            place = next((p for p in places if p.layer == task.layer), places[0])
            self._on_result(
                LayerResult(
                    task.step,
                    place.layer,
                    place.group,
                    [],
                    {s.request_id: error for s in batch.steps},
                    {},
                    0,
                    0,
                    0,
                    0.0,
                )
            )

    def _submit(self, task: LayerTask, batch: Batch) -> None:
        pinned = set(self._pin(batch.endpoint, [s.request_id for s in batch.steps]))
        live = [s for s in batch.steps if s.request_id in pinned]
        if not live:
            return
        try:
            self._write(task, batch.session, batch.planner, live)
        finally:
            self._unpin(list(pinned))

    def _write(
        self, task: LayerTask, session: str, planner: PairPlanner, live: list[StepRequest]
    ) -> None:
        t0 = time.monotonic()
        if task.layer == ALL_LAYERS:
            layers = [pl.layer for pl in planner.local.placements]
            plans = [planner.plan_layer(layer, live) for layer in layers]
            dropped = {k: v for p in plans for k, v in p.failed.items()}
            if dropped:
                # A request refused by any layer sends nothing at all, as when layers go singly.
                plans = [
                    planner.plan_layer(layer, [s for s in live if s.request_id not in dropped])
                    for layer in layers
                ]
            descs, charged = planner.merge(plans)
        else:
            plans = [planner.plan_layer(task.layer, live)]
            dropped = dict(plans[0].failed)
            descs = Descriptors.concat(list(plans[0].per_peer.values()))
            charged = [descs.count]
        ids = [s.request_id for s in live if s.request_id not in dropped]
        failed = dict(dropped)
        if descs.count:
            try:
                self._writer(session, descs.src, descs.dst, descs.length)
            except (TransferError, KVSidecarError) as e:
                what = "every layer" if task.layer == ALL_LAYERS else f"layer {task.layer}"
                failed.update({i: f"{what}: {e}" for i in ids})
                ids = []
        latency = time.monotonic() - t0
        for i, plan in enumerate(plans):
            # One result per layer, so per-layer progress and counters read the same either way.
            self._on_result(
                LayerResult(
                    task.step,
                    plan.layer,
                    plan.group,
                    ids,
                    failed if i == 0 else {},
                    plan.req_bytes,
                    plan.nbytes,
                    charged[i],
                    sum(plan.blocks.values()),
                    latency,
                    t0,
                )
            )
