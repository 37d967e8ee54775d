"""An engine process dies (SIGKILL) while layers are flowing; its sidecar lives on and must
still end every request (at its deadline at worst), as must the peer."""

from __future__ import annotations

from collections.abc import Callable

from tests.chaos.harness import LENS, Chaos, Outcome


def test_prefill_engine_killed_mid_transfer(chaos: Callable[..., Chaos]) -> None:
    """No more layer signals: prefill's sends end at their deadline (6 s), decode hears it."""
    ch = chaos(
        "P engine SIGKILL mid-transfer",
        prefill_env={"KVSIDECAR_SEND_TIMEOUT_S": "6"},
        decode_env={"KVSIDECAR_RECV_TIMEOUT_S": "30"},
    )
    ch.start(LENS, deadline_s=30)
    ch.wait_written()
    ch.at_fault()
    ch.kill_engine("prefill")

    def expect(o: Outcome) -> list[str]:
        out = []
        if "DONE" in o.status["decode"].values():
            out.append(f"scenario: decode cannot complete: {o.status['decode']}")
        # Decode hears of it from prefill, not from its own 30 s deadline.
        if o.seconds is None or o.seconds > 15:
            out.append(f"scenario: took {o.seconds}s to end, expected < 15 s")
        return out

    ch.verify(expect=expect)


def test_decode_engine_killed_mid_transfer(chaos: Callable[..., Chaos]) -> None:
    """Prefill keeps writing into memory decode's sidecar still maps; whatever each request
    ends in, decode's cache outside the read sets is untouched (checked on the segments the
    killed engine left)."""
    ch = chaos("D engine SIGKILL mid-transfer", decode_env={"KVSIDECAR_RECV_TIMEOUT_S": "20"})
    ch.start(LENS, deadline_s=20)
    ch.wait_written()
    ch.at_fault()
    ch.kill_engine("decode")

    def expect(o: Outcome) -> list[str]:
        if o.seconds is None or o.seconds > 25:
            return [f"scenario: took {o.seconds}s to end, expected within the deadline"]
        return []

    ch.verify(expect=expect)
