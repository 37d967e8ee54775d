"""The send side uses no target decode's sidecar did not sign: from the engine link (a
target in ``AddSend``, or ``SetTarget`` after the router handed it over) an unsigned, foreign
or changed target ends the send FAILED with the reason, and nothing is connected to."""

from __future__ import annotations

import msgspec
import pytest

from app.transfer.wire.protocol import AddSend, RemoteTarget, SetTarget, Status
from app.transfer.wire.target_auth import TargetSigner
from tests.transfer.conftest import PROMPT_DIGEST, Prefill, ids, target


def _forged(kind: str) -> RemoteTarget:
    real = target("r1")
    if kind == "unsigned":
        return msgspec.structs.replace(real, signature="")
    if kind == "other key":
        return TargetSigner(b"o" * 32).sign(msgspec.structs.replace(real, signature=""))
    return msgspec.structs.replace(real, computed=real.computed + 8)  # changed after signing


KINDS = ["unsigned", "other key", "changed after signing"]


@pytest.mark.parametrize("kind", KINDS)
async def test_send_admitted_with_a_forged_target_fails_unconnected(
    prefill: Prefill, kind: str
) -> None:
    msg = AddSend(
        rank=0,
        request="r1",
        prompt_len=40,
        block_ids=ids([7, 8, 9]),
        remote=_forged(kind),
        prompt_digest=PROMPT_DIGEST,
    )
    reply = await prefill.side.add(msg)
    await prefill.tasks.settle()
    assert not reply.ok and "sign" in reply.error
    assert prefill.net.links == []  # not even a socket to the named host
    assert prefill.req().state is Status.FAILED


@pytest.mark.parametrize("kind", KINDS)
async def test_forged_target_from_the_engine_ends_the_held_send(
    prefill: Prefill, kind: str
) -> None:
    assert (await prefill.add(waiting=True)).ok
    reply = prefill.side.set_target(SetTarget(rank=0, request="r1", remote=_forged(kind)))
    await prefill.tasks.settle()
    assert not reply.ok and "sign" in reply.error
    assert prefill.net.links == []
    req = prefill.req()
    assert req.state is Status.FAILED and "sign" in req.error


async def test_signed_target_is_used(prefill: Prefill) -> None:
    assert (await prefill.add()).ok
    await prefill.tasks.settle()
    assert prefill.net.links and prefill.req().state is not Status.FAILED
