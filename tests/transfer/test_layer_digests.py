"""Decode's check of a layer's digests as it landed (``LayerDigests``, issue 51), on the receive
side alone: only the claiming prefill's are checked; a match confirms the layer; a mismatch
ends the request at once and counts once, however many layers' checks found one at the same
time. The engine memory is a stand-in that answers fixed words (the checks' logic only: the
bytes themselves are checked over real sidecars in tests/e2e/test_kv_digest*.py and on real
engines in tests/connectors/vllm/test_kv_digest_*engines.py)."""

from __future__ import annotations

import asyncio
import time

import numpy as np

from app.kvcache.desc import LayoutDesc
from app.kvcache.digest import DigestRuns
from app.transfer.wire.protocol import Ack, LayerDigests, Status
from tests.transfer.conftest import D_EPOCH, MINE, P_ENGINE, Decode

GOOD, BAD = 7, 8


class Words:
    """Engine memory whose every run digests to ``word``, after ``delay_s``; counts reads."""

    def __init__(self, word: int, delay_s: float = 0.0) -> None:
        self.word, self.delay_s, self.reads = word, delay_s, 0

    def digest(self, addrs: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        self.reads += 1
        time.sleep(self.delay_s)
        return np.full((addrs.size, 2), self.word, np.uint64)


def layer_digests(layout: LayoutDesc, layer: int, engine: str = P_ENGINE) -> LayerDigests:
    """Prefill's digests (all ``GOOD``) of the request's blocks of ``layer``."""
    pl = layout.placement(layer)
    blocks = MINE[pl.group]
    dst = np.array([pl.base + b * pl.block_stride for b in blocks], np.int64)
    runs = DigestRuns.of(
        np.full(dst.size, layer),
        np.full(dst.size, pl.group),
        dst,
        np.full(dst.size, 64),
        np.full((dst.size, 2), GOOD, np.uint64),
    )
    return LayerDigests(
        request="r1",
        sender_engine=engine,
        sender_rank=0,
        target_rank=0,
        epoch=D_EPOCH,
        digests=runs,
    )


async def test_a_layer_that_matches_is_confirmed(decode: Decode) -> None:
    decode.agent.digest_memory = Words(GOOD)
    decode.expect()
    decode.claim()
    ack = await decode.side.layer_digests(layer_digests(decode.agent.desc, 0))
    assert isinstance(ack, Ack) and ack.ok, ack
    req = decode.req()
    assert (req.digest, req.digest_early_layers, req.state.terminal) == ("ok", 1, False)


async def test_only_the_claiming_prefill_is_checked(decode: Decode) -> None:
    memory = decode.agent.digest_memory = Words(GOOD)
    decode.expect()
    decode.claim()
    ack = await decode.side.layer_digests(layer_digests(decode.agent.desc, 0, "prefill-b"))
    assert not ack.ok and "did not claim" in (ack.error or ""), ack
    assert memory.reads == 0 and decode.req().digest == "off"


async def test_layers_that_differ_at_once_end_the_request_once(decode: Decode) -> None:
    decode.agent.digest_memory = Words(BAD, delay_s=0.05)
    decode.expect()
    decode.claim()
    desc = decode.agent.desc
    acks = await asyncio.gather(
        *(decode.side.layer_digests(layer_digests(desc, pl.layer)) for pl in desc.placements)
    )
    assert len(acks) == 2 and not any(a.ok for a in acks), acks
    req = decode.req()
    assert req.state is Status.FAILED and req.error.startswith("KV digest mismatch"), req.error
    assert req.digest == "mismatch" and req.digest_mismatch is not None
    assert req.quarantined_at is not None  # prefill still writes: it is asked to drain first
    assert sum(decode.side.digests.mismatches.values()) == 1, decode.side.digests.mismatches
