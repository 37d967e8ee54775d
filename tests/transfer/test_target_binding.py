"""A send takes only the target decode signed for its own transfer and its own prompt: from
the engine link a well-signed target of another transfer (in ``AddSend``, or ``SetTarget``
after the router handed it over) ends the send FAILED naming both ids, nothing is connected
to, and the transfer the target was signed for still waits for it and takes it. A target of
this transfer signed for another prompt (captured and replayed with another prompt), one that
binds no prompt, and one of the format before prompts were bound are refused the same way and
counted."""

from __future__ import annotations

import hashlib
import hmac
import struct

import msgspec

from app.transfer.wire.protocol import AddSend, RemoteTarget, Reply, SetTarget, Status
from app.transfer.wire.target_auth import prompt_digest
from tests.transfer.conftest import MINE, PROMPT_DIGEST, Prefill, ids, target


async def test_send_admitted_with_another_transfers_target_fails_unconnected(
    prefill: Prefill,
) -> None:
    msg = AddSend(
        rank=0,
        request="r1",
        prompt_len=40,
        block_ids=ids([7, 8, 9]),
        remote=target("r2"),
        prompt_digest=PROMPT_DIGEST,
    )
    reply = await prefill.side.add(msg)
    await prefill.tasks.settle()
    assert isinstance(reply, Reply) and not reply.ok, reply
    assert "signed for transfer 'r2' was posted for 'r1'" in (reply.error or "")
    assert prefill.net.links == []  # decode's sidecar was not even connected to
    assert prefill.req().state is Status.FAILED


async def test_another_transfers_target_from_the_engine_is_not_taken(prefill: Prefill) -> None:
    assert await prefill.add("r1", waiting=True) == Reply()
    assert await prefill.add("r2", waiting=True) == Reply()
    reply = prefill.side.set_target(SetTarget(rank=0, request="r1", remote=target("r2")))
    await prefill.tasks.settle()
    assert not reply.ok and "signed for transfer 'r2' was posted for 'r1'" in (reply.error or "")
    assert prefill.net.links == []
    r1 = prefill.req("r1")
    assert r1.state is Status.FAILED and "'r2'" in r1.error
    # r2 was not touched: it still waits, and its own target is taken.
    r2 = prefill.req("r2")
    assert r2.waiting and not r2.peer and not r2.state.terminal
    assert prefill.side.set_target(SetTarget(rank=0, request="r2", remote=target("r2"))).ok
    await prefill.tasks.settle()
    assert prefill.net.links and prefill.req("r2").state is not Status.FAILED


# ---- the prompt (issue 50, item 9) ---------------------------------------------------------


def _other_prompt() -> str:
    return prompt_digest(range(1, 41))  # as long as the send's, one token apart everywhere


async def test_target_signed_for_another_prompt_is_refused_at_admission(
    prefill: Prefill,
) -> None:
    """Decode-first: a target seen on the proxy -> prefill leg, posted to prefill again with
    another prompt under the same transfer id. Its signature is good; its prompt is not the
    one this send runs."""
    msg = AddSend(
        rank=0,
        request="r1",
        prompt_len=40,
        block_ids=ids([7, 8, 9]),
        remote=target("r1", digest=_other_prompt()),
        prompt_digest=PROMPT_DIGEST,
    )
    reply = await prefill.side.add(msg)
    await prefill.tasks.settle()
    assert isinstance(reply, Reply) and not reply.ok, reply
    assert "signed for another prompt" in (reply.error or "")
    assert prefill.net.links == []  # nothing connected to, so nothing written
    assert prefill.req().state is Status.FAILED
    assert prefill.side.counters["refused_targets"] == 1


async def test_another_prompts_target_from_the_engine_is_refused(prefill: Prefill) -> None:
    """Concurrent: the target the engine fetched from the router with the transfer's token,
    signed for another prompt, ends the held send unconnected."""
    assert await prefill.add("r1", waiting=True) == Reply()
    remote = target("r1", digest=_other_prompt())
    reply = prefill.side.set_target(SetTarget(rank=0, request="r1", remote=remote))
    await prefill.tasks.settle()
    assert not reply.ok and "signed for another prompt" in (reply.error or "")
    assert prefill.net.links == []
    assert prefill.req().state is Status.FAILED
    assert prefill.side.counters["refused_targets"] == 1


async def test_target_binding_no_prompt_is_refused(prefill: Prefill) -> None:
    assert await prefill.add("r1", waiting=True) == Reply()
    reply = prefill.side.set_target(SetTarget(rank=0, request="r1", remote=target(digest="")))
    assert not reply.ok and "binds no prompt" in (reply.error or "")
    assert prefill.net.links == []


async def test_send_without_a_digest_takes_no_target(prefill: Prefill) -> None:
    """A send whose engine had no token ids to digest (prompt embeddings) binds nothing: no
    target, whatever its digest, is taken for it."""
    msg = AddSend(rank=0, request="r1", prompt_len=40, block_ids=ids([7, 8, 9]), remote=target())
    reply = await prefill.side.add(msg)
    assert isinstance(reply, Reply) and not reply.ok
    assert "one without a digest" in (reply.error or "")
    assert prefill.net.links == []


async def test_format_1_target_is_refused_by_name(prefill: Prefill) -> None:
    """A target of the release before the digest (no ``format``, no ``prompt_digest``), signed
    as that release signed it: refused saying so, not as a bad signature."""
    old = RemoteTarget("r1", "127.0.0.1", 5600, "d", "ep", 1, MINE)
    body = b"kv-sidecar target v1\x00" + msgspec.msgpack.encode(old)
    old = msgspec.structs.replace(old, signature=hmac.new(b"t" * 32, body, "sha256").hexdigest())
    assert old.format == 1  # absent from an old target: decoded as 1
    msg = AddSend(
        rank=0,
        request="r1",
        prompt_len=40,
        block_ids=ids([7, 8, 9]),
        remote=old,
        prompt_digest=PROMPT_DIGEST,
    )
    reply = await prefill.side.add(msg)
    assert isinstance(reply, Reply) and not reply.ok
    assert "of format 1: expected format 2" in (reply.error or ""), reply
    assert prefill.net.links == []
    assert prefill.side.counters["refused_targets"] == 1


def test_prompt_digest_is_sha256_of_length_and_int64_le_ids() -> None:
    """Decode and prefill may run different releases of this code: the definition is pinned
    here apart from the module."""
    ids_ = [1, 2**40, 0]
    body = struct.pack("<q", 3) + b"".join(struct.pack("<q", i) for i in ids_)
    want = hashlib.sha256(b"kv-sidecar prompt v1\x00" + body).hexdigest()
    assert prompt_digest(ids_) == want
    assert prompt_digest([1, 2]) != prompt_digest([1, 2, 0])  # the length is in it
