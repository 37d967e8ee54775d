"""Admission in a step's one-way ``BeginStep`` (the connector's path, before the forward pass):
nothing waits on decode, layers signalled while the claim is out are held and written in
order once it is taken, and a refusal that leaves no record reaches the engine as a failed
request in its next ``get_finished``."""

from __future__ import annotations

from app.transfer.wire.protocol import AddSend, Claim, ExpectRecv, Reply, Status
from tests.transfer.conftest import (
    D_ENDPOINT,
    MINE,
    PROMPT_DIGEST,
    Decode,
    Prefill,
    Stream,
    ids,
    planned,
    step,
    target,
)


def _send(rid: str = "r1", *, remote: bool = True) -> AddSend:
    return AddSend(
        rank=0,
        request=rid,
        prompt_len=40,
        block_ids=ids([7, 8, 9]),
        remote=target(rid, MINE) if remote else None,
        prompt_digest=PROMPT_DIGEST,
    )


async def test_admit_claims_in_the_background_and_replays_held_layers(
    prefill: Prefill, stream: Stream
) -> None:
    prefill.side.admit(_send())
    # Nothing asked of decode yet: the engine's call returned before any round trip.
    assert prefill.net.asked == []
    await step(prefill, 1, 0, 16)  # signalled during the forward, while the claim is out
    held = stream.tasks()
    assert [t.batches for t in held] == [[], []] and prefill.req().waiting
    await prefill.tasks.settle()
    [claim] = prefill.net.sent(Claim, D_ENDPOINT)
    assert claim.request == "r1"
    replay = stream.tasks()
    assert [(t.step, t.layer) for t in replay] == [(1, 0), (1, 1)]
    assert [planned(t) for t in replay] == [[("r1", 0, 16)]] * 2
    assert not prefill.req().waiting
    await step(prefill, 2, 16, 40)  # later layers go directly
    assert all(t.batches and t.gate is None for t in stream.tasks())


async def test_refusals_without_a_record_come_back_in_finished(prefill: Prefill) -> None:
    prefill.side.admit(_send(remote=False))
    prefill.side.admit(_send(remote=False))  # the same id again
    prefill.side.admitting = False
    prefill.side.admit(_send("r2", remote=False))
    sending, recving, failed = prefill.agent.finished()
    assert (sending, recving) == ([], [])
    assert [(f.request, f.status, f.error) for f in failed] == [
        ("r1", Status.FAILED, "request r1 is already in flight"),
        ("r2", Status.FAILED, "sidecar is shutting down; not admitting requests"),
    ]
    assert failed[0].block_ids == [[7, 8, 9]]
    assert prefill.agent.finished()[2] == []  # reported once
    assert not prefill.req().state.terminal  # the first admission of r1 stands


async def test_refused_expect_comes_back_in_finished(decode: Decode) -> None:
    msg = ExpectRecv(rank=0, request="r1", prompt_len=40, block_ids=MINE, prefill_tp=1)
    first, again = decode.side.expect(msg, report=True), decode.side.expect(msg, report=True)
    assert isinstance(first, Reply) and first.ok
    assert isinstance(again, Reply) and not again.ok
    (failed,) = decode.agent.finished()[2]
    assert (failed.request, failed.error) == ("r1", "request r1 is already expected")
