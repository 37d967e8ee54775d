"""The worker side: registration, admissions, per-layer signals and completions for one rank.

Prefill: each step's admissions and send slices go to the sidecar before the forward pass
(``begin_step``); ``save_kv_layer`` signals each attention/MLA layer as its KV is written,
``wait_for_save`` the layers vLLM does not call it for, and a speculative drafter's (written
once per draft pass; vLLM defers ``wait_for_save`` until the drafter ran). A send admitted
without a target (concurrent dispatch) gets it from the router on a thread of its own.
Decode: each step's new requests are expected at the sidecar before the forward pass, and
rank 0 posts their targets to the router after it; nothing to do per layer (the prefill
pushes); the sidecar's ``Finished`` tells which requests landed and which failed (vLLM's
``failed_recving``: it recomputes them). Pool loads and stores run on their own thread
(``pool.PoolJobs``) and end through ``get_finished`` the same way.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec

from app.config import SidecarSettings
from app.connectors.params import KV_DIGEST_MISMATCH, KV_LOAD_FAILED
from app.connectors.vllm.config import ConnectorConfig
from app.connectors.vllm.failed_loads import FailedLoads
from app.connectors.vllm.fresh_blocks import attention_views, zero_blocks
from app.connectors.vllm.metadata import Admit, Expect, KVSidecarMetadata, PoolSavesDone
from app.connectors.vllm.pacing import IdlePollPacer
from app.connectors.vllm.pool import PoolJobs
from app.connectors.vllm.registration import build_registration, kv_device, unlink_spans
from app.connectors.vllm.router_calls import fetch_target, post_target, router_client
from app.connectors.vllm.speculative import draft_layers
from app.connectors.vllm.stats import KVSidecarStats
from app.devices import Device, Event
from app.devices.memory import Exported
from app.engine_link.client import EngineLink, FinishedRequests
from app.errors import KVSidecarError, SidecarGone
from app.service import InProcessAgent
from app.transfer.requests.integrity import is_mismatch
from app.transfer.wire.protocol import FailedRequest, RemoteTarget, Status

log = logging.getLogger(__name__)


def allow_amx() -> None:
    """Ask Linux for the AMX tile state where the CPU has AMX (once per process; idempotent).

    vLLM's CPU attention picks AMX kernels on such CPUs. Measured on one: decode's worker died
    with SIGILL in ``cpu_attention_with_kv_cache`` on its first step, a one-token query over
    KV that the sidecar loaded, while the same engine alone, whose first step is a prefill,
    ran; with the permission asked here first, decode runs.
    """
    import torch

    if torch.cpu._is_amx_tile_supported():
        torch.cpu._init_amx()


def decode_target(e: Expect, info: dict[str, Any], tp_size: int) -> RemoteTarget:
    """Where prefill writes an expected request: this sidecar (``sidecar_info``) and its blocks."""
    return RemoteTarget(
        request_id=e.recv.request,
        host=str(info["host"]),
        port=int(info["port"] or 0),  # none (0) is refused by prefill's remote_target
        engine_id=str(info["engine_id"]),
        epoch=str(info["epoch"]),
        tp_size=tp_size,
        block_ids=e.recv.block_ids,
        computed=e.computed,
        prompt_digest=e.recv.prompt_digest,  # binds the target to the prompt decode holds
    )


def _host_agent(config: ConnectorConfig, rank: int) -> InProcessAgent:
    """Start this worker's agent in-process: the settings a sidecar container would read
    (``KVSIDECAR_*`` in the environment), with what the connector knows set from it."""
    settings = SidecarSettings(
        role=config.role,
        engine_id=config.engine_id,
        ranks=[rank],
        tp_size=config.tp_size,
        engine_ipc=config.sidecar,
    )
    agent = InProcessAgent(settings)
    agent.start()
    log.info("rank %d hosts its agent in-process (engine socket %s)", rank, config.sidecar)
    return agent


class WorkerSide:
    def __init__(self, config: ConnectorConfig, rank: int, vllm_config: Any, kv_cache_config: Any):
        self.config = config
        self.rank = rank
        self.stage = config.pp_stage or 0  # pipeline stage
        self.vllm_config = vllm_config
        self.kv_cache_config = kv_cache_config
        self.agent = _host_agent(config, rank) if config.agent == "in_process" else None
        self.link = EngineLink(
            config.sidecar, config.engine_id, rank, timeout_s=config.link_timeout_s
        )
        self.layer_index: dict[str, int] = {}
        # Indices of the layers vLLM calls save_kv_layer for (attention, MLA).
        self.attention_layers: frozenset[int] = frozenset()
        # A speculative drafter's layers: written once per draft pass, final only at
        # wait_for_save, which vLLM defers until the drafter ran.
        self.draft_layers: frozenset[int] = frozenset()
        self._step = 0
        self._active = False
        self._forward = True  # this step runs a forward pass
        self._pacer = IdlePollPacer(config.idle_poll_s, wait=not config.data_parallel)
        self._signalled: set[int] = set()
        self._warned_at_end = False
        self._gone_said = False  # a dead sidecar was logged; quiet until a step reaches one
        self._vllm_ids: dict[str, str] = {}  # sidecar id -> this engine's request id (sends)
        self._sent: set[str] = set()  # sends the sidecar ended, not yet finished in vLLM
        self._vllm_finished: set[str] = set()
        self._failed_recvs: list[str] = []
        self._load_errors: dict[str, str] = {}  # vLLM id -> why its load failed, to report
        self._recv_ids: dict[str, str] = {}  # sidecar id -> this engine's request id (loads)
        self._to_post: list[Expect] = []  # rank 0: expected this step, targets posted after it
        self._posts = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvs-router")
        # Each holds a send's target fetch, which waits until decode posted it: one per
        # concurrent request in flight.
        self._fetches = ThreadPoolExecutor(max_workers=32, thread_name_prefix="kvs-target")
        self._router = router_client()  # both pools' calls, kept alive between requests
        self.pool = PoolJobs(config, rank) if config.pool else None
        self._saving: set[str] = set()  # vLLM ids whose prompt is being stored
        self._lock = threading.Lock()
        self._device: Device | None = None  # the KV's device when it is not the CPU
        self._exported: list[Exported] = []  # device KV shared with the sidecar, kept open
        self.stats = KVSidecarStats(ranks=config.tp_size)  # vLLM's transfer stats (stats.py)
        # Per group, the attention layers' views and kernel blocks a block, where the pool
        # stores tails: a fresh block's pages are zeroed before anything lands (fresh_blocks).
        self._zeroed: dict[int, list[tuple[Any, int]]] = {}
        self.failed_loads = FailedLoads()  # a failed load's blocks, zeroed (failed_loads.py)

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        device = kv_device(kv_caches)
        self._device = None if device.kind == "cpu" else device
        if device.kind == "cpu":
            allow_amx()
        reg = build_registration(
            vllm_config=self.vllm_config,
            kv_cache_config=self.kv_cache_config,
            kv_caches=kv_caches,
            engine_id=self.config.engine_id,
            rank=self.rank,
            tp_size=self.config.tp_size,
            exported=self._exported,
            with_draft=self.config.transfer_draft_kv,
        )
        self.layer_index = {layer.name: i for i, layer in enumerate(reg.layers)}
        self.attention_layers = frozenset(
            i for i, layer in enumerate(reg.layers) if reg.groups[layer.group].kind != "mamba"
        )
        drafts = draft_layers(self.layer_index, self.vllm_config)
        self.draft_layers = frozenset(self.layer_index[n] for n in drafts)
        self.failed_loads.register(reg, kv_caches)
        try:
            compat = self.link.register_engine(reg)
            if self.link.pool_tails:
                self._zeroed = attention_views(reg, kv_caches)
        finally:
            # Both processes map the memory now (or registration failed): the name is no longer
            # needed, and unlinked the memory ends with the last mapping, however vLLM exits
            # (its shutdown kills torch's shm manager before that one could clean up).
            if reg.device_memory is None:
                unlink_spans(reg.memory)
        log.info(
            "rank %d registered %d layers, %d groups, %d blocks with the sidecar (model %s)",
            self.rank,
            len(reg.layers),
            len(reg.groups),
            reg.num_blocks,
            compat,
        )

    def begin_step(self, meta: KVSidecarMetadata) -> None:
        """Before the forward pass (vLLM's ``bind_connector_metadata``): one one-way message
        with the step's expects, admissions and slices. vLLM 0.32+ runs ``start_load_kv``
        only after the forward pass, where every ``save_kv_layer`` would already have found
        the step unannounced."""
        self._register_again()  # before the step's transfers reach a sidecar that restarted
        if self._zeroed and meta.fresh:
            # Before the forward pass writes them and before a load or a push can land there.
            zero_blocks(self._zeroed, meta.fresh)
            if self._device is not None and (meta.pool_loads or meta.expects):
                self._device.event().synchronize()  # landing is not ordered on the stream
        self._forward = meta.forward
        self._active = bool(meta.slices)
        self._signalled = set()
        if not (meta.slices or meta.admits or meta.expects):
            return
        if self._active:
            self._step += 1
        rank = self.rank
        expects = [msgspec.structs.replace(e.recv, rank=rank) for e in meta.expects]
        admits = [a.for_stage(rank, self.stage) for a in meta.admits]
        for a in meta.admits:
            self._vllm_ids[a.send.request] = a.req_id
        try:
            self.link.begin_step(self._step, meta.slices, admits=admits, expects=expects)
        except KVSidecarError as err:
            # The forward pass goes on without the sidecar: these requests end here (decode
            # recomputes once its own sidecar gives up waiting). A dead sidecar is said once,
            # not on every step until one is back.
            if not (isinstance(err, SidecarGone) and self._gone_said):
                log.error("step %d not announced to the sidecar: %s", self._step, err)
            self._gone_said = isinstance(err, SidecarGone)
            self._active = False
            self._sent.update(a.request for a in admits)
            with self._lock:
                self._failed_recvs.extend(e.req_id for e in meta.expects)
            return
        self._gone_said = False
        for exp in meta.expects:
            self._recv_ids[exp.recv.request] = exp.req_id
            self.failed_loads.expect(exp.req_id, exp.recv.block_ids, exp.computed)
            # Posted after the forward pass: no Claim can reach a rank that does not know the
            # request yet, and vLLM has zeroed the blocks by then.
            if rank == 0 and exp.router_url:
                self._to_post.append(exp)
        for a in meta.admits:
            if a.send.remote is None and a.router_url:
                self._fetches.submit(self._fetch, a)

    def _fetch(self, a: Admit) -> None:
        """Wait for decode's target and hand it to this rank's sidecar; without one, end the
        send now (its blocks go back) instead of at the sidecar's deadline."""
        assert a.router_url is not None
        sid = a.send.request
        got = fetch_target(
            self._router,
            a.router_url,
            sid,
            a.fetch_timeout_s,
            a.token,
            self.stage,
            self.config.pp_size,
        )
        try:
            if isinstance(got, str):
                log.warning("send %s: no target (%s); ending it", sid, got)
                self.link.abort(sid, f"no target from decode: {got}")
            else:
                self.link.set_target(sid, got)
        except KVSidecarError as e:
            # Ended already (its deadline, an abort): the sidecar reports it in get_finished.
            log.warning("send %s: %s", sid, e)

    def save_kv_layer(self, layer_name: str) -> None:
        if not self._active:
            return
        index = self.layer_index.get(layer_name)
        if index is not None and index not in self._signalled and index not in self.draft_layers:
            self._signalled.add(index)
            self._signal(index, self._event())

    def _signal(self, index: int, event: Event | None, *, at_step_end: bool = False) -> None:
        """Tell the sidecar a layer is written. A sidecar that died (or stopped reading)
        mid-forward must not fail vLLM's forward pass: the step's layers stop here, and its
        sends end in ``get_finished`` (at once for a dead sidecar, else at its deadline)."""
        try:
            self.link.layer_ready(self._step, index, event, at_step_end=at_step_end)
        except KVSidecarError as e:
            log.error("step %d: layer %d not signalled, nor any after it: %s", self._step, index, e)
            self._active = False

    def _event(self) -> Event | None:
        """On a device, an event recorded on the current stream right after the layer's
        reshape-and-cache; the engine link does not signal the layer before it completed.
        On CPU the KV is written already (None)."""
        return self._device.event() if self._device is not None else None

    def wait_for_save(self, meta: KVSidecarMetadata | None) -> None:
        if self._active:
            if not self._signalled and self.attention_layers and not self._warned_at_end:
                # The push degraded to a bulk write after the forward pass (the step was not
                # announced before it, or vLLM never called save_kv_layer).
                self._warned_at_end = True
                log.warning(
                    "step %d: no attention layer was signalled during the forward pass; all "
                    "%d are sent only now, after it (not layer by layer). Is "
                    "bind_connector_metadata called before the forward pass?",
                    self._step,
                    len(self.attention_layers),
                )
            # Layers vLLM never calls save_kv_layer for (state layers), and the drafter's, are
            # final now.
            event = self._event()  # after the whole forward pass: covers every layer left
            for index in range(len(self.layer_index)):
                if self._active and index not in self._signalled:
                    self._signal(index, event, at_step_end=True)
        if self._active:
            self._active = False
            try:
                self.link.end_step(self._step)
            except KVSidecarError as e:
                log.warning("end of step %d not told to the sidecar: %s", self._step, e)
        if meta is None:
            return
        if self.rank == 0 and self.stage == 0:  # one count an engine
            self.stats.skipped(meta.skipped)
        if self._to_post:
            self._post_targets()
        if self.pool is not None:
            # After the forward pass: vLLM has zeroed newly allocated blocks by now.
            for job in meta.pool_loads:
                self.failed_loads.expect(job.req_id, job.block_ids, job.held)
                self.pool.load(job)
            # A running request's store reads what this step's forward pass writes: on a
            # device it waits for the pass to finish (an event recorded after it).
            ready = self._event() if any(job.running for job in meta.pool_saves) else None
            for job in meta.pool_saves:
                if not job.running:  # a running request's store ends in pool_saves_done
                    self._saving.add(job.req_id)
                self.pool.save(job, ready if job.running else None)

    def _post_targets(self) -> None:
        """Rank 0, after the step that allocated (and zeroed) the blocks ran."""
        expects, self._to_post = self._to_post, []
        try:
            info = self.link.sidecar_info()
        except KVSidecarError as err:
            log.error("sidecar info unavailable (%s); %d target(s) not posted", err, len(expects))
            return  # the sidecar's deadline ends those loads; vLLM recomputes them
        try:
            # Signed by the sidecar: prefill's sidecar uses no target without its signature.
            targets = self.link.sign_targets(
                [decode_target(e, info, self.config.tp_size) for e in expects]
            )
        except KVSidecarError as err:
            log.error("sidecar did not sign %d target(s): %s; not posted", len(expects), err)
            return
        for e, target in zip(expects, targets, strict=True):
            assert e.router_url is not None
            self._posts.submit(
                post_target,
                self._router,
                e.router_url,
                e.recv.request,
                target,
                e.token,
                stage=self.stage,
                pp_size=self.config.pp_size,
            )

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str], set[str]]:
        """(sends ended, loads ended, loads among them that failed).

        Failures are reported per request, never as block ids: vLLM cannot map block ids back
        to requests when the model has several KV cache groups (it stops the engine), and a
        whole-request recompute is right for every model."""
        self._vllm_finished |= finished_req_ids & set(self._vllm_ids.values())
        fin = FinishedRequests([], [], [])  # what the sidecar is not asked for now waits for it
        # Any step asks only when the sidecar rang (app.devices.bell), or once a second: a
        # decoding engine's forward steps asked on each, a round trip a token for nothing.
        if self._pacer.due(self._forward) and self.link.may_have_finished():
            try:
                fin = self.link.get_finished()
            except SidecarGone as e:
                fin = self._sidecar_gone(e)
            except KVSidecarError as e:
                log.error("sidecar unreachable for get_finished: %s", e)
        recving = {self._recv_ids.pop(sid, sid) for sid in fin.recving}
        failed: set[str] = set()
        for sid in fin.sending:
            self._sent.add(sid)
        for f in fin.failed:
            if f.request in self._vllm_ids:
                log.warning("send %s ended %s: %s", f.request, f.status.name, f.error)
                self._sent.add(f.request)
            else:
                log.warning(
                    "load of %s ended %s: %s; recomputing", f.request, f.status.name, f.error
                )
                rid = self._recv_ids.pop(f.request, f.request)
                failed.add(rid)
                self._load_errors[rid] = (
                    KV_DIGEST_MISMATCH if is_mismatch(f.error) else KV_LOAD_FAILED
                )
        with self._lock:
            failed.update(self._failed_recvs)
            self._failed_recvs = []
        self.stats.record(fin, failed)  # before the pool's: only sidecar transfers count
        sending = set()
        if self.pool is not None:
            loaded, saved, pool_failed = self.pool.drain()
            recving |= loaded
            failed |= pool_failed
            self._saving -= saved
            # A request that also sends ends when both are done (below, for the send).
            sending |= saved - set(self._vllm_ids.values())
        # Before vLLM reads the failures (and frees those blocks): see failed_loads.py.
        self.failed_loads.ended(finished_req_ids, recving, failed)
        for sid in list(self._sent):
            rid = self._vllm_ids.get(sid, sid)
            if rid in self._vllm_finished and rid not in self._saving:
                sending.add(rid)
                self._sent.discard(sid)
                self._vllm_finished.discard(rid)
                self._vllm_ids.pop(sid, None)
        return sending, recving | failed, failed

    def pool_saves_done(self) -> PoolSavesDone | None:
        """Running requests' stores that ended on this rank since the last step, and why its
        loads that failed in it failed (the scheduler tells the router: ``kv_load_error``)."""
        done = self.pool.take_running() if self.pool is not None else set()
        errors, self._load_errors = self._load_errors, {}
        return PoolSavesDone(dict.fromkeys(done, 1), errors) if done or errors else None

    def _register_again(self) -> None:
        """A sidecar came back after this rank's closed the link: register the same memory
        with it, and transfers resume without an engine restart."""
        try:
            if self.link.reregister():
                log.warning("rank %d registered its KV with the new sidecar", self.rank)
        except KVSidecarError as e:
            log.error(
                "rank %d could not register with the new sidecar (%s); this engine serves "
                "without transfers until it restarts",
                self.rank,
                e,
            )

    def _sidecar_gone(self, err: SidecarGone) -> FinishedRequests:
        """The sidecar closed the link: every load it was doing fails now (vLLM recomputes),
        and every send ends, its blocks back to vLLM once vLLM finished the request. Safe: the
        process that would have read those blocks is gone (a stalled one keeps the link open,
        and its calls wait their deadlines instead)."""
        loads = list(self._recv_ids)
        sends = [sid for sid in self._vllm_ids if sid not in self._sent]
        if loads or sends:
            log.error(
                "%s; failing %d load(s) (recomputed) and ending %d send(s)",
                err,
                len(loads),
                len(sends),
            )
        reason = "the sidecar closed the engine link (exited or killed)"
        failed = [FailedRequest(sid, Status.FAILED, [], reason) for sid in loads]
        return FinishedRequests(sends, [], failed)

    def close(self) -> None:
        self._posts.shutdown(wait=False)
        self._fetches.shutdown(wait=False, cancel_futures=True)
        self._router.close()
        if self.pool is not None:
            self.pool.close()
        self.link.close(unlink=False)
        if self.agent is not None:
            self.agent.stop()
        for ex in self._exported:
            ex.close()
