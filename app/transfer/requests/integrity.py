"""The KV digest of a push (issue 51): prefill digests what each of its ranks wrote to each
decode rank, decode digests the same runs in its own memory before the request may end DONE.

Prefill plans the request's whole prompt once more (one step from the first token decode lacks
to the prompt's end: the union of what its steps wrote) and sends, per decode rank, the runs'
decode addresses with their digests; decode needs no prefill layout. Only host memory is
digested (the CPU path); a sidecar holding device memory sends no digests and checks none.
"""

from __future__ import annotations

import logging

import numpy as np

from app.kvcache.digest import (
    DigestMismatch,
    DigestRuns,
    DigestStats,
    DigestVerdict,
    HostMemory,
    digest_runs,
    first_mismatch,
)
from app.transfer.planning.planner import PairPlanner, StepRequest
from app.transfer.requests.agent import Agent, RecvRequest, SendRequest

log = logging.getLogger(__name__)

MISMATCH = "KV digest mismatch"
"""How a failed request's error begins when decode's check found a mismatch: the engine's
connector tells its router why decode recomputed (``is_mismatch``)."""


def is_mismatch(error: str) -> bool:
    """Whether a request's error says its KV digest check failed (else another failure)."""
    return error.startswith(MISMATCH)


def host_memory(agent: Agent) -> HostMemory | None:
    """The agent's engine memory as mapped here, or None for device memory (not digested)."""
    reg = agent.registration
    if reg is None or agent.device_memory or len(agent.memory) != len(reg.memory):
        return None
    spans = []
    for buf, span in zip(agent.memory, reg.memory, strict=True):
        ptr = getattr(buf, "data_ptr", None)
        if ptr is None:
            return None
        spans.append((int(ptr()) + span.offset, span.size))
    return HostMemory(tuple(spans))


def sender_digests(
    agent: Agent, planner: PairPlanner, req: SendRequest, stats: DigestStats
) -> dict[int, DigestRuns]:
    """Per decode rank, the runs this rank wrote for ``req`` and their digests over its own
    (source) bytes; empty when its memory is not host memory."""
    memory = host_memory(agent)
    if memory is None:
        return {}
    step = StepRequest(
        req.id,
        req.prompt_len,
        min(req.skip, req.prompt_len),
        req.prompt_len,
        req.blocks,
        req.d_blocks,
        req.mamba_mode,
        req.num_spec,
    )
    parts: dict[int, list[tuple[int, int, np.ndarray, np.ndarray, np.ndarray]]] = {}
    for pl in agent.desc.placements:
        plan = planner.plan_layer(pl.layer, [step])
        for d_rank, descs in plan.per_peer.items():
            sums = digest_runs(memory, descs.src, descs.length)
            parts.setdefault(d_rank, []).append((pl.layer, pl.group, descs.dst, descs.length, sums))
            stats.add("prefill", descs.count, descs.nbytes)
    out = {}
    for d_rank, ps in parts.items():
        out[d_rank] = DigestRuns.of(
            np.concatenate([np.full(p[2].size, p[0]) for p in ps]),
            np.concatenate([np.full(p[2].size, p[1]) for p in ps]),
            np.concatenate([p[2] for p in ps]),
            np.concatenate([p[3] for p in ps]),
            np.concatenate([p[4] for p in ps]),
        )
    return out


def check_digests(
    agent: Agent, req: RecvRequest, sender_rank: int, runs: DigestRuns, stats: DigestStats
) -> DigestVerdict:
    """Whether the bytes prefill rank ``sender_rank`` wrote for ``req`` match what it read
    (unchecked when this memory is not digested). A run outside the request's own blocks is
    refused unread."""
    memory = host_memory(agent)
    if memory is None:
        return DigestVerdict()
    try:
        layers, groups, dst, length, want = runs.arrays()
    except ValueError as e:
        return DigestVerdict(f"prefill rank {sender_rank}: {e}")
    desc = agent.desc
    block_of = np.zeros(dst.size, np.int64)
    triples = zip(layers.tolist(), groups.tolist(), dst.tolist(), strict=True)
    for i, (layer, group, addr) in enumerate(triples):
        try:
            pl = desc.placement(layer)
        except (KeyError, IndexError, ValueError):
            return DigestVerdict(
                f"prefill rank {sender_rank}: digest of layer {layer}, which this rank lacks"
            )
        block = (addr - pl.base) // pl.block_stride if pl.block_stride else -1
        if pl.group != group or block not in req.blocks[group]:
            return DigestVerdict(
                f"prefill rank {sender_rank}: digest run 0x{addr:x} of layer {layer} group "
                f"{group} lies outside request {req.id}'s blocks"
            )
        block_of[i] = block
    got = digest_runs(memory, dst, length)
    stats.add("decode", int(dst.size), int(length.sum()))
    bad = first_mismatch(got, want)
    if bad is None:
        return DigestVerdict(checked=True)
    group = int(groups[bad])
    kind = str(desc.groups[group].kind)
    with stats.lock:
        stats.mismatches[(kind, "decode")] += 1
    where = DigestMismatch(
        sender_rank, int(layers[bad]), group, kind, int(block_of[bad]), int(length[bad])
    )
    why = (
        f"{MISMATCH} from prefill rank {sender_rank}: layer {where.layer}, group "
        f"{group} ({kind}), block {where.block} ({where.nbytes} B at "
        f"0x{int(dst[bad]):x}); decode recomputes the request"
    )
    log.warning("request %s: %s", req.id, why)
    return DigestVerdict(why, True, where)
