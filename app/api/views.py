"""Read-only snapshots of a running sidecar, as the admin API's response models.

Everything here runs on the sidecar's event loop, where every request and counter is mutated
(stream threads hand their results back with ``call_soon_threadsafe``), so reading takes no lock
of the transfer path and never waits on a transfer. The one exception is Mooncake's own counters
and session id, behind a lock that its writers hold only for an increment or a swap.
"""

from __future__ import annotations

import platform
import queue
import time
from dataclasses import asdict, fields
from datetime import UTC, datetime
from functools import cache
from importlib import metadata
from typing import Any

import msgspec

from app.api.schemas import (
    DigestMismatchView,
    GroupProgressView,
    GroupsResponse,
    GroupView,
    LayerTimelineView,
    MooncakeStatus,
    PeersResponse,
    PeerView,
    PoolCallView,
    PoolResponse,
    RankRegions,
    RankStatus,
    RegionsResponse,
    RegionView,
    RegistrationResponse,
    RequestState,
    RequestView,
    StatusResponse,
    StepView,
    StreamView,
    Versions,
)
from app.kvcache.desc import GroupDesc
from app.kvcache.digest import DigestMismatch
from app.transfer.requests.agent import (
    Agent,
    GroupProgress,
    GroupStats,
    RecvRequest,
    Request,
    SendRequest,
)
from app.transfer.requests.timeline import StepRecord
from app.transfer.sidecar.process import Sidecar
from app.transfer.wire.protocol import PROTOCOL_VERSION, Status


def _dist_version(*names: str) -> str | None:
    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


@cache
def versions() -> Versions:
    # Distribution metadata, not imports: asking must not load torch or Mooncake.
    return Versions(
        kv_sidecar=_dist_version("kv-sidecar") or "unknown",
        torch=_dist_version("torch"),
        mooncake=_dist_version("mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine"),
        python=platform.python_version(),
        protocol=PROTOCOL_VERSION,
    )


def readiness(sidecar: Sidecar) -> tuple[bool, str]:
    """``Sidecar.ready``, and not ready once shutdown began (take it out of rotation)."""
    ok, reason = sidecar.ready
    if ok and not sidecar.admitting:
        return False, "shutting down: not admitting requests"
    return ok, reason


def queue_depth(q: queue.Queue[Any]) -> int:
    # len() of the underlying deque, not qsize(): no lock shared with the stream thread.
    return len(q.queue)


def side_of(req: Request) -> str:
    return "send" if isinstance(req, SendRequest) else "recv"


def _rank_status(sidecar: Sidecar, rank: int) -> RankStatus:
    agent = sidecar.agents.get(rank)
    if agent is None:
        return RankStatus(rank=rank, registered=False)
    desc = agent.desc
    ended = {"send": 0, "recv": 0}
    for (side, _state), n in list(agent.terminal.items()):
        ended[side] = ended.get(side, 0) + n
    stream = agent.stream
    return RankStatus(
        rank=rank,
        registered=True,
        engine_id=agent.engine_id,
        tp_size=desc.tp,
        num_blocks=desc.num_blocks,
        null_block=desc.null_block,
        kv_layout=desc.kv_layout,
        layout_mode=desc.layout_mode,
        groups=len(desc.groups),
        regions=len(desc.regions),
        sends_in_flight=sum(not r.state.terminal for r in list(agent.sends.values())),
        recvs_in_flight=sum(not r.state.terminal for r in list(agent.recvs.values())),
        sends_ended=ended["send"],
        recvs_ended=ended["recv"],
        stream_queue_depth=queue_depth(stream.queue) if stream else 0,
        stream_queue_capacity=stream.queue.maxsize if stream else 0,
        layers_signalled_in_forward=agent.step_log.in_forward,
        layers_signalled_at_step_end=agent.step_log.at_step_end,
        last_step=_step_view(last, _wall()) if (last := agent.step_log.last()) else None,
    )


def _wall() -> float:
    """Add to a monotonic time to get Unix time (read now: both clocks at one moment)."""
    return time.time() - time.monotonic()


def _step_view(rec: StepRecord, wall: float) -> StepView:
    return StepView(
        step=rec.step,
        began_at=rec.began + wall,
        forward_ended_at=None if rec.forward_ended is None else rec.forward_ended + wall,
        layers_in_forward=rec.in_forward,
        layers_at_step_end=rec.at_step_end,
    )


def _timeline(req: SendRequest, wall: float) -> tuple[list[LayerTimelineView], list[StepView]]:
    def at(t: float | None) -> float | None:
        return None if t is None else t + wall

    layers = [
        LayerTimelineView(
            step=t.step,
            layer=t.layer,
            group=t.group,
            signalled_at=t.signalled + wall,
            at_step_end=t.at_step_end,
            submitted_at=at(t.submitted),
            landed_at=at(t.landed),
            bytes=t.bytes,
        )
        for t in sorted(req.timeline.layers.values(), key=lambda t: (t.step, t.layer))
    ]
    steps = [_step_view(rec, wall) for _, rec in sorted(req.timeline.steps.items())]
    return layers, steps


def status(sidecar: Sidecar) -> StatusResponse:
    s = sidecar.settings
    ready, reason = readiness(sidecar)
    ranks = sorted({*s.ranks, *sidecar.agents})
    engine = sidecar.engine
    mooncake = None
    if engine is not None:
        c = engine.counters()
        mooncake = MooncakeStatus(session=engine.session_id, transport=s.transport, **c)
    return StatusResponse(
        engine_id=s.engine_id,
        role=s.role,
        epoch=sidecar.epoch,
        ready=ready,
        reason=reason,
        admitting=sidecar.admitting,
        tp_size=sidecar.tp_size,
        compat_hash=sidecar.compat_hash or None,
        control_endpoint=sidecar.control_endpoint or None,
        engine_ipc=s.engine_ipc,
        ranks=[_rank_status(sidecar, r) for r in ranks],
        mooncake=mooncake,
        handshakes=sidecar.counters.get("handshakes", 0),
        expired=sidecar.counters.get("expired", 0),
        started_at=datetime.fromtimestamp(sidecar.started, UTC),
        uptime_s=round(time.time() - sidecar.started, 3),
        versions=versions(),
    )


def regions(sidecar: Sidecar) -> RegionsResponse:
    out = []
    for rank, agent in sorted(sidecar.agents.items()):
        d = agent.desc
        out.append(
            RankRegions(
                rank=rank,
                tp_size=d.tp,
                num_blocks=d.num_blocks,
                null_block=d.null_block,
                kv_layout=d.kv_layout,
                layout_mode=d.layout_mode,
                regions=[
                    RegionView(
                        base=f"{r.base:#x}",
                        length=r.length,
                        block_stride=r.block_stride,
                        kind=r.kind,
                        group=r.group,
                        layers=list(r.layers),
                        streams=[StreamView(offset=x.offset, length=x.length) for x in r.streams],
                    )
                    for r in d.regions
                ],
            )
        )
    return RegionsResponse(ranks=out)


def groups(sidecar: Sidecar) -> GroupsResponse:
    """Per group, counters summed over this sidecar's ranks (descriptions from the lowest)."""
    descs: dict[int, GroupDesc] = {}
    ranks: dict[int, list[int]] = {}
    sums: dict[int, GroupStats] = {}
    for rank, agent in sorted(sidecar.agents.items()):
        for g in agent.desc.groups:
            descs.setdefault(g.index, g)
            ranks.setdefault(g.index, []).append(rank)
            acc = sums.setdefault(g.index, GroupStats())
            st = agent.groups.get(g.index)
            if st is not None:
                for f in fields(GroupStats):
                    setattr(acc, f.name, getattr(acc, f.name) + getattr(st, f.name))
    return GroupsResponse(
        groups=[
            GroupView(
                index=i,
                spec=descs[i].kind,
                block_size=descs[i].block_size,
                kernel_block_size=descs[i].kernel_block_size,
                sliding_window=descs[i].sliding_window,
                layers=list(descs[i].layers),
                ranks=ranks[i],
                **asdict(sums[i]),
            )
            for i in sorted(descs)
        ]
    )


def request_view(req: Request, now: float | None = None, timeline: bool = False) -> RequestView:
    """One request on one rank; with ``timeline`` a send's per-layer and per-step times."""
    now = time.monotonic() if now is None else now
    wall = _wall()
    final = req.state.terminal
    groups: list[GroupProgressView] = []
    senders = targets = None
    if isinstance(req, RecvRequest):
        # Decode sees no per-layer writes, only each sender's Done for its groups.
        done = {p for p, st in req.delivered.items() if st is Status.DONE}
        senders = {str(p): "DONE" if p in done else "PENDING" for p in sorted(req.manifest)}
        for i, b in enumerate(req.blocks):
            carriers = {p for p, gs in req.manifest.items() if i in gs}
            groups.append(
                GroupProgressView(
                    group=i,
                    blocks=int(b.size),
                    block_ids=b.tolist(),
                    layers_sent=None,
                    bytes=None,
                    delivered=carriers <= done,
                )
            )
    else:
        if isinstance(req, SendRequest):
            targets = sorted(req.d_ranks)
        none = GroupProgress()
        for i, b in enumerate(req.blocks):
            prog = req.groups.get(i, none)
            groups.append(
                GroupProgressView(
                    group=i,
                    blocks=int(b.size),
                    block_ids=b.tolist(),
                    layers_sent=prog.layers_sent,
                    bytes=prog.bytes,
                    delivered=None,
                )
            )
    layers = steps = None
    if timeline and isinstance(req, SendRequest):
        layers, steps = _timeline(req, wall)
    return RequestView(
        id=req.id,
        rank=req.rank,
        side="send" if isinstance(req, SendRequest) else "recv",
        state=RequestState(req.state.name),
        prompt_len=req.prompt_len,
        peer=req.peer or None,
        held_layers=len(req.backlog) if isinstance(req, SendRequest) and req.waiting else None,
        age_s=round(now - req.created, 4),
        deadline_in_s=None if final else round(req.deadline - now, 4),
        duration_s=(
            round(req.finished_at - req.created, 4)
            if final and req.finished_at is not None
            else None
        ),
        bytes=req.bytes,
        groups=groups,
        senders=senders,
        targets=targets,
        reported=req.reported,
        quarantined=isinstance(req, RecvRequest) and req.quarantined_at is not None,
        error=req.error or None,
        digest=req.digest,
        digest_mismatch=_mismatch_view(req.digest_mismatch),
        digest_ms=req.digest_ms,
        digest_early_layers=req.digest_early_layers,
        digest_early_ms=req.digest_early_ms,
        digest_early_checks=req.digest_early_checks,
        traceparent=req.traceparent,
        created_at=req.created + wall,
        ended_at=None if req.finished_at is None else req.finished_at + wall,
        reported_at=None if req.reported_at is None else req.reported_at + wall,
        claimed_at=(
            req.claimed_at + wall
            if isinstance(req, RecvRequest) and req.claimed_at is not None
            else None
        ),
        layers=layers,
        steps=steps,
    )


def _mismatch_view(m: DigestMismatch | None) -> DigestMismatchView | None:
    if m is None:
        return None
    return DigestMismatchView(
        sender_rank=m.sender_rank,
        layer=m.layer,
        group=m.group,
        kind=m.kind,
        block=m.block,
        bytes=m.nbytes,
    )


def live_requests(sidecar: Sidecar) -> list[Request]:
    """Requests the agents hold: in flight, or final and not yet reported to the engine."""
    out: list[Request] = []
    for _rank, agent in sorted(sidecar.agents.items()):
        out += list(agent.sends.values())
        out += list(agent.recvs.values())
    return out


def ended_requests(sidecar: Sidecar) -> list[Request]:
    """Recently ended requests the agents keep for the admin API (the last 256 per rank)."""
    out: list[Request] = []
    for _rank, agent in sorted(sidecar.agents.items()):
        out += list(agent.history)
    return out


def find_request(sidecar: Sidecar, rid: str) -> list[Request]:
    """Every (rank, side) copy of ``rid``: the live one, else the latest in the history."""
    found: list[Request] = []
    for _rank, agent in sorted(sidecar.agents.items()):
        found += _find_on(agent, rid)
    return found


def _find_on(agent: Agent, rid: str) -> list[Request]:
    out: dict[str, Request] = {}
    for req in reversed(list(agent.history)):
        if req.id == rid:
            out.setdefault(side_of(req), req)
    live: list[Request | None] = [agent.sends.get(rid), agent.recvs.get(rid)]
    for cur in live:
        if cur is not None:
            out[side_of(cur)] = cur
    return [out[s] for s in ("send", "recv") if s in out]


def registrations(sidecar: Sidecar) -> RegistrationResponse:
    return RegistrationResponse(
        ranks={
            str(rank): msgspec.to_builtins(agent.registration)
            for rank, agent in sorted(sidecar.agents.items())
            if agent.registration is not None
        }
    )


def pool(sidecar: Sidecar) -> PoolResponse:
    svc = sidecar.pool
    if svc is None:
        zeros = dict.fromkeys(_POOL_COUNTERS, 0)
        return PoolResponse(
            enabled=False, master_address=None, lookups=0, hit_tokens=0, recent=[], **zeros
        )
    c = svc.client.counters()
    return PoolResponse(
        enabled=True,
        master_address=svc.client.config.master_address,
        lookups=svc.lookups,
        hit_tokens=svc.hit_tokens,
        recent=[PoolCallView(**asdict(call)) for call in svc.recent_calls()],
        late_loads=svc.running.counters.late_loads,
        late_saves=svc.running.counters.late_saves,
        late_released=svc.running.counters.released,
        late_stuck=svc.running.counters.stuck,
        **{k: getattr(c, k) for k in _POOL_COUNTERS},
    )


_POOL_COUNTERS = (
    "hits",
    "misses",
    "keys_put",
    "keys_skipped",
    "keys_got",
    "bytes_put",
    "bytes_got",
    "backpressure",
    "failures",
    "timeouts",
    "late_returns",
    "late_running",
)


def peers(sidecar: Sidecar) -> PeersResponse:
    return PeersResponse(
        peers=[
            PeerView(
                endpoint=p.endpoint,
                engine_id=p.engine_id or None,
                epoch=p.epoch or None,
                te_session=p.te_session or None,
                ranks=sorted(p.descs),
                last_handshake=(
                    datetime.fromtimestamp(p.last_handshake, UTC)
                    if p.last_handshake is not None
                    else None
                ),
                handshakes=p.handshakes,
                failures=p.failures,
                last_error=p.last_error or None,
                heard_s_ago=round(time.monotonic() - p.last_heard, 3),
            )
            for p in sorted(list(sidecar.peers.values()), key=lambda p: p.endpoint)
        ]
    )
