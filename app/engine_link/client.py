"""The engine-side shim: what an inference worker calls, shaped after vLLM's connector hooks.

``register_engine`` → ``add_send_request`` / ``expect_receive`` → per step ``begin_step`` and
``layer_ready(layer, event)`` → ``get_finished``. The engine and its sidecar are separate
processes; KV memory is shared as POSIX shared memory (CPU) or exported device memory
(``app.devices.memory``), so registering only sends names and handles.
Calls are synchronous (vLLM workers are), each with a deadline; ``layer_ready`` is one-way and
never waits on the transfer path.

Events: with an event ring (``create_event_ring`` before registering) ``layer_ready``
records the layer's event in the ring and the sidecar waits on it before writing. Without one,
a layer whose event is not complete yet is signalled by a waiter thread once it is; either way
the caller is not blocked (except by a ring slot the sidecar still holds) and the rank's
``LayerReady`` messages keep their order.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec
import numpy as np

from app.devices import CpuEvent, Event
from app.devices.bell import Bell, BellWatch
from app.devices.events import DEFAULT_SLOTS, EngineRing
from app.devices.fdpass import FdServer
from app.devices.shm import SHM_DIR
from app.devices.spec import FdSource
from app.engine_link.signals import LayerSignals
from app.engine_link.sync_client import SyncClient
from app.errors import KVSidecarError
from app.kvcache.engine_spec import EngineRegistration
from app.store.hashing import KeyRun
from app.transfer.planning.planner import MambaMode
from app.transfer.wire.protocol import (
    AbortRequest,
    AddSend,
    AnyMsg,
    BeginStep,
    EndStep,
    ExpectRecv,
    FailedRequest,
    Finished,
    GetFinished,
    LayerReady,
    Msg,
    PoolLoad,
    PoolLoaded,
    PoolLookup,
    PoolPoll,
    PoolRunning,
    PoolSave,
    RegisterEngine,
    RemoteTarget,
    Reply,
    RequestTotals,
    SetTarget,
    SidecarInfo,
    SignedTargets,
    SignTargets,
    StepSlice,
)

log = logging.getLogger(__name__)


class EngineLinkError(KVSidecarError):
    """The sidecar refused or failed an engine call; the message is the sidecar's sentence."""


@dataclass(frozen=True)
class FinishedRequests:
    sending: list[str]
    recving: list[str]
    failed: list[FailedRequest]
    bytes: int = 0  # this rank's totals so far, for summaries
    descriptors: int = 0
    totals: tuple[RequestTotals, ...] = ()  # per request ended: bytes, duration (vLLM stats)


class EngineLink:
    """One engine rank's connection to its sidecar."""

    def __init__(
        self,
        endpoint: str,
        engine_id: str,
        rank: int,
        *,
        timeout_s: float = 10.0,
        shm_prefix: str | None = None,
    ) -> None:
        self.client = SyncClient(endpoint)
        self.engine_id = engine_id
        self.rank = rank
        self.timeout_s = timeout_s
        # Names this rank's event ring (and, by convention, the engine's KV segments).
        self.shm_prefix = shm_prefix or f"kvs-{secrets.token_hex(4)}"
        self.ring: EngineRing | None = None
        self.epoch = ""
        self.control_port = 0
        # The sidecar's pool stores this engine's tails: fresh blocks are zeroed (fresh_blocks).
        self.pool_tails = False
        # The waiter thread sends too, and a ZMQ socket is not thread-safe.
        self._lock = threading.Lock()
        self._signals = LayerSignals(self._notify)
        self._registered: _Registered | None = None  # what ``reregister`` sends again
        self._registered_on = 0  # the connection (``client.connects``) it was registered on
        # The finished bell of the current registration (none until one was mapped).
        self.bell = BellWatch(None)

    @property
    def sidecar_gone(self) -> bool:
        """The sidecar closed the link (exited or killed) and no sidecar has connected since:
        it can no longer read this engine's memory, and nothing it was asked will be answered."""
        with self._lock:
            return self.client.gone

    def _notify(self, msg: Msg) -> None:
        with self._lock:
            self.client.notify(msg)

    def _call(self, msg: Msg, timeout: float | None = None) -> AnyMsg:
        with self._lock:
            reply = self.client.request(msg, timeout or self.timeout_s)
        if isinstance(reply, Reply) and not reply.ok:
            raise EngineLinkError(reply.error or "sidecar refused the call")
        if not isinstance(reply, Reply | Finished | PoolLoaded | PoolRunning | SignedTargets):
            raise EngineLinkError(
                f"unexpected reply {type(reply).__name__}: {getattr(reply, 'reason', '')}"
            )
        return reply

    def create_event_ring(
        self, layers: int, device: str = "cpu", slots: int = DEFAULT_SLOTS
    ) -> EngineRing:
        """A fresh event ring for the next registration (the previous one is closed)."""
        if self.ring is not None:
            self.ring.close()
        kind, _, index = device.partition(":")
        self.ring = EngineRing.create(
            layers,
            device=kind,
            index=int(index or 0),
            slots=slots,
            prefix=self.shm_prefix,
            timeout_s=max(self.timeout_s, 60.0),
        )
        return self.ring

    def register_engine(self, registration: EngineRegistration, timeout_s: float = 60.0) -> str:
        """Register KV memory the engine allocated itself; returns the compat hash. For an
        event ring, ``create_event_ring`` first and put its ``spec`` in ``events``.

        CPU memory without a ring can be registered again with a sidecar that replaces this
        one (``reregister``): its files are kept open here for that, since the engine removes
        their names once this sidecar mapped them."""
        again = _Registered.of(registration) if self.ring is None else None
        try:
            compat = self._register(registration, timeout_s)
        except BaseException:
            if again is not None:
                again.close()
            raise
        if self._registered is not None:
            self._registered.close()
        self._registered = again
        with self._lock:
            self._registered_on = self.client.connects if not self.client.gone else -1
        return compat

    def _register(self, registration: EngineRegistration, timeout_s: float) -> str:
        # A fresh bell each registration; its name goes once the sidecar mapped it, or failed.
        bell = Bell.create(self.shm_prefix)
        registration = msgspec.structs.replace(registration, bell=bell.name)
        try:
            reply = self._call(RegisterEngine(registration=registration), timeout_s)
        except BaseException:
            bell.close()
            raise
        finally:
            bell.unlink()
        assert isinstance(reply, Reply)
        self.epoch = str(reply.data.get("epoch", ""))
        self.control_port = int(reply.data.get("control_port") or 0)
        self.pool_tails = bool(reply.data.get("pool_tails", False))
        old = self.bell.bell
        if reply.data.get("bell"):
            self.bell = BellWatch(bell)
        else:  # not mapped: ask every time, as without a bell
            bell.close()
            self.bell = BellWatch(None)
        if old is not None:
            old.close()
        return str(reply.data.get("compat_hash", ""))

    def reregister(self, timeout_s: float = 30.0) -> bool:
        """Register the same memory with a sidecar that connected since this one's sidecar
        closed the link (a restarted sidecar), serving the memory as descriptors. False when
        there is nothing to do: no new sidecar, or memory that cannot be registered again
        (device memory, an event ring: the engine restarts for those). Tried once per new
        sidecar; a refusal raises ``EngineLinkError``."""
        with self._lock:
            if self.client.gone or self.client.connects <= self._registered_on:
                return False
            self._registered_on = self.client.connects
        if self._registered is None:
            return False
        path = f"{SHM_DIR}/{self.shm_prefix}-r{self.rank}.fds"
        token = secrets.token_bytes(32)
        # The server closes the copies it serves; the files kept here stay open.
        server = FdServer(path, [os.dup(fd) for fd in self._registered.fds], token)
        served = FdSource(socket=path, token=token)
        try:
            self._register(
                msgspec.structs.replace(self._registered.registration, memory_fds=served),
                timeout_s,
            )
        finally:
            server.close()
        return True

    def sidecar_info(self) -> dict[str, str | int | float | bool | None]:
        """The sidecar's control address, epoch and readiness."""
        reply = self._call(SidecarInfo())
        assert isinstance(reply, Reply)
        return dict(reply.data)

    def sign_targets(self, targets: Sequence[RemoteTarget]) -> list[RemoteTarget]:
        """``targets`` (naming this sidecar) signed by it, in order
        (app.transfer.wire.target_auth)."""
        reply = self._call(SignTargets(targets=list(targets)))
        assert isinstance(reply, SignedTargets)
        return reply.targets

    def add_send_request(
        self,
        request: str,
        prompt_len: int,
        block_ids: Sequence[np.ndarray] | Sequence[Sequence[int]],
        remote: RemoteTarget | None,
        *,
        mamba_mode: MambaMode = MambaMode.NONE,
        num_spec: int = 0,
        target_timeout_s: float | None = None,
        traceparent: str | None = None,
        prompt_digest: str = "",
    ) -> None:
        """Admit a send; without ``remote`` the sidecar keeps its layers until ``set_target``
        (at most ``target_timeout_s``, else the sidecar's send deadline). ``traceparent``
        (W3C) makes the send's spans children of that span; ``prompt_digest`` names the prompt
        decode's target must be signed for (target_auth.prompt_digest)."""
        self._call(
            AddSend(
                rank=self.rank,
                request=request,
                prompt_len=prompt_len,
                block_ids=_wire_ids(block_ids),
                remote=remote,
                mamba_mode=mamba_mode,
                num_spec=num_spec,
                target_timeout_s=target_timeout_s,
                traceparent=traceparent,
                prompt_digest=prompt_digest,
            )
        )

    def set_target(self, request: str, remote: RemoteTarget) -> None:
        """Where a send admitted without a target goes; returns once decode took the claim."""
        self._call(SetTarget(rank=self.rank, request=request, remote=remote))

    def expect_receive(
        self,
        request: str,
        prompt_len: int,
        block_ids: Sequence[np.ndarray] | Sequence[Sequence[int]],
        prefill_tp: int,
        *,
        timeout_s: float | None = None,
        traceparent: str | None = None,
    ) -> None:
        """Expect a receive; ``traceparent`` (W3C) makes its span a child of that span."""
        self._call(
            ExpectRecv(
                rank=self.rank,
                request=request,
                prompt_len=prompt_len,
                block_ids=_wire_ids(block_ids),
                prefill_tp=prefill_tp,
                timeout_s=timeout_s,
                traceparent=traceparent,
            )
        )

    def begin_step(
        self,
        step: int,
        slices: Sequence[StepSlice],
        *,
        admits: Sequence[AddSend] = (),
        expects: Sequence[ExpectRecv] = (),
    ) -> None:
        """Announce a step before its forward pass: admissions and expects first, then its
        token slices. One-way: returns once queued (DESIGN §2c: nothing on the critical path
        waits for the sidecar); a refused admission comes back in ``get_finished``."""
        self._notify(
            BeginStep(
                rank=self.rank,
                step=step,
                slices=list(slices),
                admits=list(admits),
                expects=list(expects),
            )
        )

    def end_step(self, step: int) -> None:
        """The forward pass of ``step`` ended (one-way; for the per-layer timeline)."""
        self._notify(EndStep(rank=self.rank, step=step))

    def layer_ready(
        self, step: int, layer: int, event: Event | None = None, *, at_step_end: bool = False
    ) -> None:
        """Signal that ``layer``'s KV of ``step`` is written once ``event`` completed (None:
        already); ``at_step_end`` when it is signalled only after the forward pass. With a
        ring the event goes into it and the sidecar waits; without, a pending event is waited
        for by a thread here. Never blocks on the event itself."""
        if self.ring is not None and layer >= 0:
            slot, seq = self.ring.record(layer, event)
            msg = LayerReady(
                rank=self.rank, step=step, layer=layer, slot=slot, seq=seq, at_step_end=at_step_end
            )
            try:
                self._signals.put(msg, None)
            except KVSidecarError:
                self.ring.abandon(layer, slot, seq)  # the sidecar will never release it
                raise
            return
        msg = LayerReady(rank=self.rank, step=step, layer=layer, at_step_end=at_step_end)
        self._signals.put(msg, event)

    def may_have_finished(self) -> bool:
        """Whether a ``get_finished`` may find something: the sidecar rang this rank's bell
        since the last, ``bell.SAFETY_S`` passed (always true without a bell), or the sidecar
        is gone (the call then fails at once, and the worker ends what it was doing)."""
        return self.bell.due() or self.sidecar_gone

    def get_finished(self) -> FinishedRequests:
        self.bell.asking()
        reply = self._call(GetFinished(rank=self.rank))
        assert isinstance(reply, Finished)
        return FinishedRequests(
            reply.sending,
            reply.recving,
            reply.failed,
            reply.bytes,
            reply.descriptors,
            tuple(reply.totals),
        )

    def pool_lookup(
        self, request: str, token_ids: Sequence[int], extra_keys: Sequence[KeyRun] = ()
    ) -> int:
        """Tokens of this prompt the KV pool can serve (vLLM's hybrid hit rule)."""
        reply = self._call(
            PoolLookup(
                rank=self.rank,
                request=request,
                token_ids=list(token_ids),
                extra_keys=_wire_runs(extra_keys),
            )
        )
        assert isinstance(reply, Reply)
        return int(reply.data.get("hit_tokens") or 0)

    def pool_save(
        self,
        request: str,
        token_ids: Sequence[int],
        block_ids: Sequence[np.ndarray] | Sequence[Sequence[int]],
        num_computed: int,
        extra_keys: Sequence[KeyRun] = (),
        stored_tokens: int = 0,
    ) -> dict[str, int]:
        """Store fully computed blocks (none ending at or before ``stored_tokens``, which this
        request's earlier saves stored); the blocks may be freed on return, unless
        the reply says ``pending`` (the put still reads them: ``pool_poll`` until it returned).
        A ``DeadlineExceeded`` says as little: the sidecar may have begun the put."""
        reply = self._call(
            PoolSave(
                rank=self.rank,
                request=request,
                token_ids=list(token_ids),
                block_ids=_wire_ids(block_ids),
                num_computed=num_computed,
                extra_keys=_wire_runs(extra_keys),
                stored_tokens=stored_tokens,
            ),
            self.timeout_s * 3,
        )
        assert isinstance(reply, Reply)
        return {k: int(v or 0) for k, v in reply.data.items()}

    def pool_load(
        self,
        request: str,
        token_ids: Sequence[int],
        block_ids: Sequence[np.ndarray] | Sequence[Sequence[int]],
        hit_tokens: int,
        extra_keys: Sequence[KeyRun] = (),
        held_tokens: int = 0,
    ) -> PoolLoaded:
        """Load a hit into ``block_ids``, less the ``held_tokens`` the engine's own cache hit
        holds; ``failed_blocks`` must be recomputed. A ``pending`` reply (or a
        ``DeadlineExceeded``) means the get may still write the blocks: ``pool_poll`` until it
        returned, then recompute."""
        reply = self._call(
            PoolLoad(
                rank=self.rank,
                request=request,
                token_ids=list(token_ids),
                block_ids=_wire_ids(block_ids),
                hit_tokens=hit_tokens,
                extra_keys=_wire_runs(extra_keys),
                held_tokens=held_tokens,
            ),
            self.timeout_s * 3,
        )
        assert isinstance(reply, PoolLoaded)
        return reply

    def pool_poll(self, loads: Sequence[str], saves: Sequence[str]) -> tuple[set[str], set[str]]:
        """(loads, saves) of those asked about whose store call still runs; the others are
        settled. Sent on the link that sent them: the sidecar reads a link's frames in order,
        so a load or save still queued there is registered before this poll is answered."""
        reply = self._call(PoolPoll(rank=self.rank, loads=list(loads), saves=list(saves)))
        assert isinstance(reply, PoolRunning)
        return set(reply.loads), set(reply.saves)

    def abort(self, request: str, reason: str = "aborted by engine", *, wait: bool = True) -> None:
        """End a request as ABORTED; ``wait=False`` sends it one-way (vLLM's scheduler loop)."""
        msg = AbortRequest(rank=self.rank, request=request, reason=reason)
        if wait:
            self._call(msg)
        else:
            self._notify(msg)

    def close(self, unlink: bool = True) -> None:
        if self._registered is not None:
            self._registered.close()
        self._signals.close()
        with self._lock:
            self.client.close()
        if self.ring is not None:
            self.ring.close(unlink=unlink)
        if self.bell.bell is not None:
            self.bell.bell.close()
            self.bell = BellWatch(None)


@dataclass
class _Registered:
    """A CPU registration and its memory files, kept open to be registered again."""

    registration: EngineRegistration
    fds: list[int]

    @classmethod
    def of(cls, reg: EngineRegistration) -> _Registered | None:
        if reg.device_memory is not None or reg.events is not None or reg.memory_fds is not None:
            return None
        fds: list[int] = []
        try:
            for span in reg.memory:
                fds.append(os.open(f"{SHM_DIR}/{span.name}", os.O_RDWR))
        except OSError:
            for fd in fds:
                os.close(fd)
            return None  # not /dev/shm files this process can open: registered once only
        return cls(reg, fds)

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = []


def _wire_runs(runs: Sequence[KeyRun]) -> list[tuple[int, list[object]]]:
    return [(n, list(keys)) for n, keys in runs]


def _wire_ids(block_ids: Sequence[np.ndarray] | Sequence[Sequence[int]]) -> list[list[int]]:
    """Block ids per group as the wire carries them (lists), from arrays or lists."""
    return [b.tolist() if isinstance(b, np.ndarray) else [int(x) for x in b] for b in block_ids]


__all__ = ["CpuEvent", "EngineLink", "EngineLinkError", "FinishedRequests"]
