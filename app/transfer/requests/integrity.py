"""The KV digest of a push (issue 51): prefill digests what each of its ranks wrote to each
decode rank, decode digests the same runs in its own memory before the request may end DONE.

Prefill plans the request's whole prompt once more (one step from the first token decode lacks
to the prompt's end: the union of what its steps wrote) and sends, per decode rank, the runs'
decode addresses with their digests (a layer's once the next is written, in ``LayerDigests``
while the engine computes; the last two layers' in ``Done``); decode needs no prefill layout.
Host memory is digested with numpy over the sidecar's mapping, device memory (CUDA, NPU) with
torch ops on the device (``kvcache.tensor_digest``); both give the same words, so the two sides
may differ in kind.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from app.kvcache.digest import (
    DigestMismatch,
    DigestRuns,
    DigestStats,
    DigestVerdict,
    HostMemory,
    KvMemory,
    first_mismatch,
)
from app.kvcache.tensor_digest import TensorMemory
from app.transfer.planning.planner import PairPlanner, StepRequest
from app.transfer.requests.agent import Agent, RecvRequest, SendRequest

MISMATCH = "KV digest mismatch"
"""How a failed request's error begins when decode's check found a mismatch: the engine's
connector tells its router why decode recomputed (``is_mismatch``)."""


def is_mismatch(error: str) -> bool:
    """Whether a request's error says its KV digest check failed (else another failure)."""
    return error.startswith(MISMATCH)


def kv_memory(spans: Sequence[tuple[int, int]], tensors: Sequence[Any] = ()) -> KvMemory:
    """An engine's registered spans ``(address, size)`` as the digest reads them here: the
    mapped pages, or, given the engine's uint8 device ``tensors`` (one per span, each holding
    its span), those tensors' bytes of each span."""
    if not tensors:
        return HostMemory(tuple(spans))
    views = []
    for (addr, size), t in zip(spans, tensors, strict=True):
        start = addr - int(t.data_ptr())
        views.append((addr, t[start : start + size]))
    return TensorMemory(tuple(views))


LayerDigest = list[tuple[int, int, int, np.ndarray, np.ndarray, np.ndarray]]
"""One layer's digested runs per decode rank: (decode rank, layer, group, decode addresses,
lengths, words)."""


def layer_digest(
    agent: Agent, planner: PairPlanner, req: SendRequest, layer: int, stats: DigestStats
) -> LayerDigest:
    """The runs this rank wrote of ``layer`` for ``req`` (its whole prompt: the union of its
    steps' writes), each with its digest over this rank's (source) bytes; empty when the sidecar
    owns the memory (no engine registered it)."""
    memory = agent.digest_memory
    if memory is None:
        return []
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
    group = agent.desc.placement(layer).group
    out = []
    for d_rank, descs in planner.plan_layer(layer, [step]).per_peer.items():
        sums = memory.digest(descs.src, descs.length)
        out.append((d_rank, layer, group, descs.dst, descs.length, sums))
        stats.add("prefill", descs.count, descs.nbytes)
    return out


def sender_digests(
    agent: Agent,
    planner: PairPlanner,
    req: SendRequest,
    stats: DigestStats,
    early: Mapping[int, LayerDigest] | None = None,
) -> dict[int, DigestRuns]:
    """Per decode rank, every layer's ``layer_digest`` for ``req``: those in ``early`` (made
    while the engine computed later ones, less what decode already checked) as they are, the
    others now."""
    if agent.digest_memory is None:
        return {}
    parts: LayerDigest = []
    for pl in agent.desc.placements:
        got = (early or {}).get(pl.layer)
        parts += layer_digest(agent, planner, req, pl.layer, stats) if got is None else got
    return digest_runs(parts)


def digest_runs(parts: LayerDigest) -> dict[int, DigestRuns]:
    """``parts`` (of one layer or many) as the wire carries them, per decode rank."""
    by_rank: dict[int, LayerDigest] = {}
    for part in parts:
        by_rank.setdefault(part[0], []).append(part)
    out = {}
    for d_rank, ps in by_rank.items():
        out[d_rank] = DigestRuns.of(
            np.concatenate([np.full(p[3].size, p[1]) for p in ps]),
            np.concatenate([np.full(p[3].size, p[2]) for p in ps]),
            np.concatenate([p[3] for p in ps]),
            np.concatenate([p[4] for p in ps]),
            np.concatenate([p[5] for p in ps]),
        )
    return out


def check_digests(
    agent: Agent, req: RecvRequest, sender_rank: int, runs: DigestRuns, stats: DigestStats
) -> DigestVerdict:
    """Whether the bytes prefill rank ``sender_rank`` wrote for ``req`` match what it read
    (unchecked when the sidecar owns the memory). A run outside the request's own blocks is
    refused unread. The caller counts and logs a mismatch, once a request."""
    memory = agent.digest_memory
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
    got = memory.digest(dst, length)
    stats.add("decode", int(dst.size), int(length.sum()))
    bad = first_mismatch(got, want)
    if bad is None:
        return DigestVerdict(checked=True)
    group = int(groups[bad])
    kind = str(desc.groups[group].kind)
    where = DigestMismatch(
        sender_rank, int(layers[bad]), group, kind, int(block_of[bad]), int(length[bad])
    )
    why = (
        f"{MISMATCH} from prefill rank {sender_rank}: layer {where.layer}, group "
        f"{group} ({kind}), block {where.block} ({where.nbytes} B at "
        f"0x{int(dst[bad]):x}); decode recomputes the request"
    )
    return DigestVerdict(why, True, where)
