"""An engine aborts a request while its layers are flowing (``AbortRequest`` on the engine
link, as vLLM's scheduler does on a client abort), from either side. The aborted request ends
ABORTED on both sides (never DONE); the others arrive byte-exact."""

from __future__ import annotations

from collections.abc import Callable

import httpx

from app.sim.commands import Command
from tests.chaos.harness import LENS, Chaos, Outcome

ENV = {"KVSIDECAR_SEND_TIMEOUT_S": "30", "KVSIDECAR_RECV_TIMEOUT_S": "30"}
ABORTED = "req-1"


def _others_done(o: Outcome) -> list[str]:
    out = []
    for role in ("prefill", "decode"):
        others = {k: v for k, v in o.status[role].items() if k != ABORTED}
        if set(others.values()) != {"DONE"}:
            out.append(f"scenario: the requests not aborted should end DONE on {role}: {others}")
    return out


def test_prefill_engine_aborts_mid_layer(chaos: Callable[..., Chaos]) -> None:
    """Prefill's engine aborts after the 20th layer signal (chunk 3 of 8): prefill tells
    decode, which ends the request ABORTED at once instead of at its deadline (30 s)."""
    ch = chaos("P engine abort mid-layer", sidecar_env=ENV)
    ch.start(LENS, deadline_s=30, abort=[ABORTED], abort_after_layers=20)
    reply = ch.collect()["prefill"]
    aborted_at = reply["aborted_at"]
    assert aborted_at is not None
    ch.fault_at = aborted_at
    entries = httpx.get(f"{ch.p.admin_url}/v1/requests/{ABORTED}", timeout=10).json()["entries"]
    sent = sum(e["bytes"] for e in entries)

    def expect(o: Outcome) -> list[str]:
        out = _others_done(o)
        for role in ("prefill", "decode"):
            if o.status[role][ABORTED] != "ABORTED":
                out.append(f"scenario: {ABORTED} on {role}: {o.status[role][ABORTED]}")
        ended = o.at("decode", ABORTED)
        if ended is None or ended - aborted_at > 5:
            out.append(
                f"scenario: decode ended {ABORTED} {ended and ended - aborted_at}s "
                "after the abort, expected < 5 s"
            )
        if not sent:
            out.append(f"scenario: no layer of {ABORTED} had been sent when it was aborted")
        return out

    ch.notes.append(f"{sent} B of {ABORTED} sent before the abort")
    ch.verify(expect=expect)


def test_decode_engine_aborts_mid_layer(chaos: Callable[..., Chaos]) -> None:
    """Decode's engine aborts while prefill is still signalling layers."""
    ch = chaos("D engine abort mid-layer", sidecar_env=ENV)
    pairs = ch.start(LENS, deadline_s=30, wait=False)
    ch.wait_written()
    d_req = next(dr for _, dr in pairs if dr.id == ABORTED)
    aborted_at = ch.c.call(ch.d, Command(cmd="abort", requests=[d_req]), 30)["aborted_at"]
    ch.fault_at = aborted_at
    ch.wait_decode()
    prefill = ch.collect()["prefill"]

    def expect(o: Outcome) -> list[str]:
        out = _others_done(o)
        if o.status["decode"][ABORTED] != "ABORTED":
            out.append(f"scenario: {ABORTED} on decode: {o.status['decode'][ABORTED]}")
        if o.status["prefill"][ABORTED] not in ("ABORTED", "FAILED"):
            out.append(f"scenario: {ABORTED} on prefill: {o.status['prefill'][ABORTED]}")
        if not prefill["first_layer_at"] < aborted_at < prefill["last_layer_at"]:
            out.append("scenario: the abort did not come while prefill was signalling layers")
        ended = o.at("decode", ABORTED)
        if ended is None or ended - aborted_at > 5:
            out.append(
                f"scenario: decode ended {ABORTED} {ended and ended - aborted_at}s "
                "after the abort, expected < 5 s"
            )
        return out

    ch.verify(expect=expect)
