"""The scheduler side: which requests load remotely (decode) or send (prefill), and their blocks.

It never waits on the sidecar: vLLM calls these hooks inside its scheduler loop, so every
sidecar call happens on the workers (or, for pool lookups, on a thread of their own).

A decode request with ``do_remote_prefill`` loads the prompt minus the one token decode
recomputes (and minus what its own prefix cache holds), asynchronously. Once its blocks are
allocated, every worker has its sidecar rank expect it before the step's forward pass (so no
``Done`` can arrive for an unknown request), and rank 0 posts its target to the router after
that step ran (so the prefill's writes cannot land before vLLM's zeroing). A prefill request
with ``do_remote_decode`` is admitted at the sidecar by the workers, with decode's target
(decode first) or without it: concurrent, the workers fetch it from the router; prefill first
(vLLM's standard flow, any router), decode posts it to this sidecar's ``target_url``, which
prefill's answer names in its ``kv_transfer_params``. It keeps its blocks until the sidecar
reports the send ended. Both sidecars know the transfer by the proxy's transfer id (prefill
first: this engine's request id).

With ``"pool": true`` any other request (and a prefill's before it computes) first asks the
sidecar's KV pool for the longest prefix hit and loads it asynchronously; a finished request's
prompt is stored into the pool before its blocks go back to vLLM (``pool_requests``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from vllm.v1.kv_cache_interface import MambaSpec
from vllm.v1.request import RequestStatus

from app.connectors.params import (
    KV_LOAD_ERROR_PARAM,
    KV_LOAD_PARAM,
    KV_SEND_ERROR_PARAM,
    KV_SEND_PARAM,
    TRANSFER_TOKEN_PARAM,
)
from app.connectors.vllm.config import ConnectorConfig
from app.connectors.vllm.fresh_blocks import FreshBlocks
from app.connectors.vllm.metadata import (
    Admit,
    BlockIds,
    Expect,
    KVSidecarMetadata,
)
from app.connectors.vllm.pool_keys import kv_inputs, without_keys
from app.connectors.vllm.pool_requests import PoolRequests
from app.engine_link.client import EngineLink
from app.errors import KVSidecarError, ProtocolError
from app.tracing.traceparent import parse as parse_traceparent
from app.transfer.planning.planner import MambaMode
from app.transfer.wire.protocol import (
    MAX_DEADLINE_S,
    AddSend,
    ExpectRecv,
    RemoteTarget,
    StepSlice,
)
from app.transfer.wire.target_auth import prompt_digest, remote_target

log = logging.getLogger(__name__)


@dataclass
class _Send:
    sid: str
    remote: RemoteTarget | None  # None: fetched from ``router_url``, or posted to the sidecar
    router_url: str | None
    target_timeout_s: float
    prompt_len: int  # the whole prompt, as decode has it
    block_ids: BlockIds
    computes: int  # tokens this engine computes: the prompt, or one fewer when truncated
    traceparent: str | None
    prompt_digest: str  # of the whole prompt: decode's target must be signed for it
    token: str | None = None  # the transfer's capability at the router
    # Decode first: decode's target per pipeline stage (``remote`` is stage 0's).
    stage_remotes: list[RemoteTarget] = field(default_factory=list)
    admitted: bool = False
    grown: bool = False
    sliced: bool = False


@dataclass(frozen=True)
class _Whole:
    """A prefill prompt as decode holds it, taken before ``_truncate`` dropped its last token."""

    digest: str  # _digest of the whole prompt
    truncated: bool


# The attribute of vLLM's Request that holds its ``_Whole``: on the request, not in its
# ``kv_transfer_params``, which are the client's to write.
_WHOLE = "_kvs_whole"


@dataclass
class _State:
    sends: dict[str, _Send] = field(default_factory=dict)  # vLLM request id -> send
    unfinished_sends: set[str] = field(default_factory=set)  # kept blocks, awaiting the sidecar
    recvs: dict[str, str] = field(default_factory=dict)  # decode requests expected -> sid
    expects: list[Expect] = field(default_factory=list)
    local_hits: dict[str, int] = field(default_factory=dict)  # decode's own prefix hit
    failed_loads: set[str] = field(default_factory=set)  # expected requests whose load failed
    load_errors: dict[str, str] = field(default_factory=dict)  # ...and why, where a worker said
    skipped: set[str] = field(default_factory=set)  # counted in ``skips`` already
    new_skips: list[str] = field(default_factory=list)  # their reasons, for the next step


def _params(request: Any) -> dict[str, Any]:
    return dict(getattr(request, "kv_transfer_params", None) or {})


def _token(p: dict[str, Any]) -> str | None:
    token = p.get(TRANSFER_TOKEN_PARAM)
    return token if isinstance(token, str) and token else None


def _traceparent(p: dict[str, Any]) -> str | None:
    """The proxy's W3C traceparent (README "Tracing"); one that does not parse is dropped."""
    tp = parse_traceparent(p.get("traceparent"))
    return None if tp is None else tp.header


class SchedulerSide:
    """Per engine (not per rank): talks to the sidecar on behalf of every local rank."""

    def __init__(self, config: ConnectorConfig, kv_cache_config: Any = None) -> None:
        self.config = config
        states = [
            g.kv_cache_spec
            for g in getattr(kv_cache_config, "kv_cache_groups", ())
            if isinstance(g.kv_cache_spec, MambaSpec)
        ]
        mode = str(states[0].mamba_cache_mode) if states else "none"
        # None: a mode the sidecar cannot plan; every send is refused (decode recomputes).
        self.mamba_mode = MambaMode(mode) if mode in set(MambaMode) else None
        if self.mamba_mode is None:
            log.error("mamba_cache_mode %r is not supported (expected none or align)", mode)
        self.num_spec = int(states[0].num_speculative_blocks) if states else 0
        self.state = _State()
        self.pool = PoolRequests(config, kv_cache_config, self._skip)
        groups = getattr(kv_cache_config, "kv_cache_groups", ())
        self.fresh = (
            FreshBlocks([int(g.kv_cache_spec.block_size) for g in groups])
            if config.pool and groups
            else None
        )
        # Requests that went without the pool or a transfer, by reason (pool_keys.SKIP_*).
        self.skips: dict[str, int] = {}
        # One per rank of every pipeline stage, for one-way aborts (they never wait for the
        # sidecar) and to see a sidecar die: connected now, while the sidecars the workers
        # registered with are up, so a later exit shows on the links' monitors.
        self.links = [
            EngineLink(stage.sidecar, stage.engine_id, rank, timeout_s=stage.link_timeout_s)
            for stage in config.stages()
            for rank in range(stage.tp_size)
        ]

    # ---- vLLM hooks ------------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Any, num_computed: int
    ) -> tuple[int | None, bool]:
        p = _params(request)
        rid = request.request_id
        if self.fresh is not None:
            self.fresh.hit(rid, num_computed)
        unkeyed = without_keys(request)
        if unkeyed is not None:
            # Prompt embeddings: no token ids to key or truncate, and no transfer (prefill
            # sends nothing, decode computes the prompt). Client input never raises here.
            self._skip(rid, unkeyed, "no KV transfer and no KV pool")
            return 0, False
        if p.get("do_remote_decode"):
            self._truncate(request)
        if not p.get("do_remote_prefill"):
            return self.pool.hit(request, num_computed)
        if rid in self.state.recvs:
            return 0, False
        # Decode recomputes the prompt's last token itself (for its logits): DESIGN §3.
        count = len(request.prompt_token_ids) - 1 - num_computed
        if count <= 0:
            return 0, False
        self.state.local_hits[rid] = num_computed
        return count, True

    def _truncate(self, request: Any) -> None:
        """Prefill computes the N - 1 tokens decode loads, never the last one (decode computes
        it). A Mamba-style state after N cannot be "un-run" (DESIGN §3, vLLM's convention);
        and the KV of N - 1 tokens is then bit for bit what one engine holds after a prefill
        of them: a prefill of N tokens rounds some of the same rows otherwise (measured: a
        37-token MLA prompt whose 36 loaded rows were byte-equal to prefill's answered
        otherwise than the engine alone).

        The whole prompt's digest is taken first: decode's target binds the prompt as decode
        holds it, last token included. Whether this ran is kept on the request, never in its
        ``kv_transfer_params`` (a client could preset a marker there and skip the cut)."""
        if getattr(request, _WHOLE, None) is not None:
            return  # vLLM asks again each step until the request is scheduled
        cut = request.num_prompt_tokens >= 2
        setattr(request, _WHOLE, _Whole(_digest(request), cut))
        if not cut:
            return
        del request.prompt_token_ids[-1]
        del request._all_token_ids[-1]  # vLLM keeps its own copy of the token list
        request.num_prompt_tokens -= 1

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external: int) -> None:
        p = _params(request)
        rid = request.request_id
        ids = [list(map(int, g)) for g in blocks.get_block_ids()]
        self.pool.allocated(request, ids, num_external)
        if self.fresh is not None:
            self.fresh.allocated(rid, ids, num_external)
        self.pool.track(request, p)
        if p.get("do_remote_prefill") and num_external > 0 and rid not in self.state.recvs:
            # The proxy's transfer id names the transfer on both sidecars; without a proxy,
            # this engine's request id.
            sid = str(p.get("transfer_id") or rid)
            self.state.recvs[rid] = sid
            recv = ExpectRecv(
                rank=0,  # each worker sets its own
                request=sid,
                prompt_len=len(request.prompt_token_ids),
                block_ids=ids,
                prefill_tp=self.config.prefill_tp,
                timeout_s=self.config.recv_timeout_s,
                queue_timeout_s=self.config.recv_queue_timeout_s,
                traceparent=_traceparent(p),
                prompt_digest=_digest(request),
            )
            computed = self.state.local_hits.pop(rid, 0)
            self.state.expects.append(Expect(rid, recv, computed, p.get("router_url"), _token(p)))
            if not p.get("router_url"):
                log.warning(
                    "request %s: no router_url in kv_transfer_params; nobody will send", rid
                )
        elif (
            p.get("do_remote_decode")
            and rid not in self.state.sends
            and without_keys(request) is None
        ):
            send = self._send(request, p, ids)
            if send is not None:
                self.state.sends[rid] = send

    def _send(self, request: Any, p: dict[str, Any], ids: BlockIds) -> _Send | None:
        rid = request.request_id
        remote: RemoteTarget | None = None
        stages: list[RemoteTarget] = []
        if p.get("remote") is not None:
            try:
                remote = remote_target(p["remote"])
                staged = p.get("remote_stages")
                stages = [remote_target(t) for t in staged] if staged else [remote]
            except ProtocolError as e:
                # As a missing target: no send; decode's deadline ends its side (it recomputes).
                log.error("request %s: %s; not sent", rid, e)
                return None
            # The id this engine's request runs under (the proxy's transfer id), not the
            # target's own: the sidecar checks the target was signed for it.
            sid = str(p.get("transfer_id") or "")
            if not sid:
                log.error(
                    "request %s: a remote target without the transfer_id it was signed for "
                    "(kv_transfer_params needs both, as the proxy sends them); not sent",
                    rid,
                )
                return None
            if len(stages) != self.config.pp_size:
                log.error(
                    "request %s: decode runs %d pipeline stage(s) and this prefill %d: each "
                    "decode stage takes the layers of the prefill stage of its number, so run "
                    "both with the same pipeline_parallel_size; not sent",
                    rid,
                    len(stages),
                    self.config.pp_size,
                )
                return None
        elif p.get("router_url") and p.get("transfer_id"):
            sid = str(p["transfer_id"])  # concurrent: the target comes later, by this id
        elif self.config.target_url:
            sid = rid  # prefill first: decode posts its target to this sidecar, by this id
        else:
            log.error(
                "request %s: do_remote_decode without a remote target or a router_url and "
                "transfer_id to fetch one, and no target_url in kv_connector_extra_config for "
                "decode to post one to (the prefill-first flow); not sent",
                rid,
            )
            return None
        # The sidecar plans with the whole prompt (decode loads all but its last token);
        # a truncated prefill computes exactly those, and its last slice ends the prompt.
        taken = getattr(request, _WHOLE, None)
        if not isinstance(taken, _Whole):  # not truncated: the prompt is whole as it is
            taken = _Whole(_digest(request), False)
        computes = len(request.prompt_token_ids)
        whole = computes + 1 if taken.truncated else computes
        timeout = float(p.get("target_timeout_s") or self.config.target_timeout_s)
        if not 0 < timeout <= MAX_DEADLINE_S:
            log.error(
                "request %s: target_timeout_s %r out of range (0, %g]; not sent",
                rid,
                p.get("target_timeout_s"),
                MAX_DEADLINE_S,
            )
            return None
        if self.mamba_mode is None:
            log.error("request %s: the model's mamba_cache_mode is not supported; not sent", rid)
            return None
        return _Send(
            sid,
            remote,
            p.get("router_url"),
            timeout,
            whole,
            ids,
            computes,
            _traceparent(p),
            taken.digest,
            _token(p),
            stages,
        )

    def build_connector_meta(self, out: Any) -> KVSidecarMetadata:
        st = self.state
        loads, saves = self.pool.take()
        meta = KVSidecarMetadata(
            expects=st.expects,
            pool_loads=loads,
            pool_saves=saves,
            forward=out.total_num_scheduled_tokens > 0,  # else vLLM runs no forward pass
        )
        st.expects = []
        meta.skipped, st.new_skips = st.new_skips, []
        if self.fresh is not None:
            self.fresh.scheduled(out)
            meta.fresh = self.fresh.take()
        computed: dict[str, int] = {}
        for new in out.scheduled_new_reqs:
            computed[new.req_id] = new.num_computed_tokens
            send = st.sends.get(new.req_id)
            if send is not None and not send.admitted:
                send.block_ids = [list(map(int, g)) for g in new.block_ids]
                meta.admits.append(self._admit(new.req_id, send))
                send.admitted = True
                st.unfinished_sends.add(new.req_id)
        cached = out.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            computed[rid] = cached.num_computed_tokens[i]
            send = st.sends.get(rid)
            grown = cached.new_block_ids[i]
            if send is not None and grown:
                for g, extra in enumerate(grown):
                    send.block_ids[g].extend(int(b) for b in extra)
                send.grown = True
        for rid, n in out.num_scheduled_tokens.items():
            send = st.sends.get(rid)
            if send is None or not send.admitted or computed.get(rid, 0) >= send.computes:
                continue
            end = min(computed[rid] + n, send.computes)
            if end == send.computes:
                end = send.prompt_len
            # Tokens loaded from the pool were never computed in a step: the first slice
            # carries them (they are final before this step runs).
            start = computed[rid] if send.sliced else 0
            grown = _copy(send.block_ids) if send.grown else None
            meta.slices.append(StepSlice(send.sid, start, end, grown))
            send.grown, send.sliced = False, True
        meta.pool_saves.extend(self.pool.step(out.num_scheduled_tokens, computed))
        for rid in out.preempted_req_ids or ():
            # A preempted prefill lost its blocks: the send cannot finish; decode recomputes.
            self._abort_send(rid, "prefill request preempted")
        return meta

    def _admit(self, req_id: str, send: _Send) -> Admit:
        assert self.mamba_mode is not None  # _send admits none otherwise
        prefill_first = send.remote is None and send.router_url is None
        msg = AddSend(
            rank=0,  # each worker sets its own
            request=send.sid,
            prompt_len=send.prompt_len,
            block_ids=_copy(send.block_ids),  # the send's own list grows with later steps
            remote=send.remote,
            mamba_mode=self.mamba_mode,
            num_spec=self.num_spec,
            # Prefill first: nobody fetches the target, the sidecar bounds the wait.
            target_timeout_s=send.target_timeout_s if prefill_first else None,
            traceparent=send.traceparent,
            prompt_digest=send.prompt_digest,
        )
        return Admit(
            req_id,
            msg,
            send.router_url,
            send.target_timeout_s,
            send.token,
            tuple(send.stage_remotes),
        )

    def request_finished(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        self.pool.forget(rid)
        if self.fresh is not None:
            self.fresh.forget(rid)
        self.state.skipped.discard(rid)
        self.state.local_hits.pop(rid, None)
        sid = self.state.recvs.pop(rid, None)
        if sid is not None:
            if request.status == RequestStatus.FINISHED_ABORTED:
                self._abort_all(sid, "decode request aborted")
            failed = rid in self.state.failed_loads
            self.state.failed_loads.discard(rid)
            why = self.state.load_errors.pop(rid, None)
            # For the conversation's next turn: prompt and answer, whoever computed them. On a
            # hybrid model the store keeps the longest prefix whose every block a hit there reads
            # is still held (a window's tail, a state at an aligned end), as for a prompt.
            keep = self.config.save_answers and self.pool.save(request, block_ids, answer=True)
            # The id both sidecars know the transfer by, for curl on their admin APIs, and
            # whether prefill's KV was used (the router's record tells "recomputed" apart).
            return keep, {
                "kv_sidecar_request_id": sid,
                KV_LOAD_PARAM: "failed" if failed else "ok",
                **({KV_LOAD_ERROR_PARAM: why} if failed and why is not None else {}),
            }
        keep = self.pool.save(request, block_ids, answer=self.pool.answers(_params(request)))
        send = self.state.sends.pop(rid, None)
        if send is None or not send.admitted:
            return keep, None
        if request.status == RequestStatus.FINISHED_ABORTED:
            self._abort_all(send.sid, "prefill request aborted")
            return keep or rid in self.state.unfinished_sends, None
        gone = [link for link in self.links if link.sidecar_gone]
        if gone:
            # Nothing was or will be sent: the router tells decode to recompute now rather
            # than at its deadline, and a prefill-first decode computes the prompt itself.
            error = (
                f"the sidecar of {gone[0].engine_id} rank {gone[0].rank} closed the engine "
                "link (exited or killed) before the send ended"
            )
            log.error("send %s: %s", send.sid, error)
            return keep or rid in self.state.unfinished_sends, {
                "kv_sidecar_request_id": send.sid,
                KV_SEND_PARAM: "failed",
                KV_SEND_ERROR_PARAM: error,
            }
        # Keep the blocks until a worker reports the send ended (get_finished).
        return keep or rid in self.state.unfinished_sends, self._decode_params(send)

    def _decode_params(self, send: _Send) -> dict[str, Any] | None:
        """Prefill first: the ``kv_transfer_params`` a router hands to decode with the prompt
        (vLLM's standard flow), naming the transfer and where decode posts its target."""
        if send.remote is not None or send.router_url is not None:
            return None
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "transfer_id": send.sid,
            "router_url": self.config.target_url,
            "remote_engine_id": self.config.engine_id,
            "kv_sidecar_request_id": send.sid,
            # Decode's spans join prefill's trace, whatever the router forwards.
            **({"traceparent": send.traceparent} if send.traceparent else {}),
        }

    def update_connector_output(self, output: Any) -> None:
        # Why loads failed comes with the same step's output as their failure (the workers'
        # PoolSavesDone): kept for the request's final kv_transfer_params.
        meta = getattr(output, "kv_connector_worker_meta", None)
        errors: dict[str, str] = getattr(meta, "load_errors", None) or {}
        for rid in getattr(output, "failed_recving", None) or ():
            if rid in self.state.recvs:
                self.state.failed_loads.add(rid)
                if rid in errors:
                    self.state.load_errors[rid] = errors[rid]
            else:
                self.pool.load_failed(rid)
        for rid in getattr(output, "finished_sending", None) or ():
            self.state.unfinished_sends.discard(rid)
            self.pool.saved(rid)
        self.pool.saves_done(getattr(output, "kv_connector_worker_meta", None))

    def has_pending_push_work(self) -> bool:
        return bool(self.state.unfinished_sends or self.pool.saving)

    # ---- helpers ---------------------------------------------------------------------------

    def _skip(self, rid: str, reason: str, what: str) -> None:
        """Count (once a request) a request that goes without the pool or a transfer."""
        if rid in self.state.skipped:
            return
        self.state.skipped.add(rid)
        self.state.new_skips.append(reason)
        self.skips[reason] = self.skips.get(reason, 0) + 1
        log.info("request %s: %s (%s)", rid, what, reason)

    def _abort_send(self, rid: str, reason: str) -> None:
        send = self.state.sends.get(rid)
        if send is not None and send.admitted:
            self._abort_all(send.sid, reason)

    def _abort_all(self, sid: str, reason: str) -> None:
        for link in self.links:
            try:
                link.abort(sid, reason, wait=False)
            except KVSidecarError as e:
                log.warning(
                    "abort of %s on %s rank %d not sent: %s", sid, link.engine_id, link.rank, e
                )

    def close(self) -> None:
        self.pool.close()
        for link in self.links:
            link.close(unlink=False)


def _digest(request: Any) -> str:
    """``prompt_digest`` of a request's prompt and of what else decides its KV (its adapter,
    its multimodal inputs: the same ids under another adapter or with another image behind the
    placeholders are other KV). Only requests with token ids get here: ``without_keys`` turns
    prompt embeddings away before any transfer is planned."""
    return prompt_digest(request.prompt_token_ids, kv_inputs(request))


def _copy(ids: BlockIds) -> BlockIds:
    return [list(g) for g in ids]
