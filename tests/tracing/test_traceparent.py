"""The W3C traceparent: what parses, what is ignored (None: the caller starts a new trace or
carries none), and what this project writes."""

from __future__ import annotations

import re

import msgspec
import pytest

from app.errors import ProtocolError
from app.tracing.traceparent import PATTERN, TraceParent, new_trace, parse
from app.transfer.wire.codec import decode, encode
from app.transfer.wire.protocol import PROTOCOL_VERSION, AddSend

GOOD = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def test_a_valid_header_parses_into_its_fields() -> None:
    tp = parse(GOOD)
    assert tp == TraceParent("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7", 1)
    assert tp.sampled and tp.header == GOOD
    assert parse(GOOD[:-2] + "00") == TraceParent(tp.trace_id, tp.span_id, 0)


def test_a_later_version_keeps_its_first_four_fields() -> None:
    # W3C: a receiver reads a higher version's known fields and ignores what follows.
    tp = parse("cc" + GOOD[2:] + "-what-comes-next")
    assert tp is not None and tp.header == GOOD


@pytest.mark.parametrize(
    "bad",
    [
        None,
        42,
        "",
        "garbage",
        GOOD.upper(),  # hex must be lowercase
        GOOD[:-1],  # too short
        GOOD + "-extra",  # version 00 has exactly four fields
        GOOD + "x",
        "ff" + GOOD[2:],  # version ff is invalid
        "00-" + "0" * 32 + "-00f067aa0ba902b7-01",  # all-zero trace id
        "00-4bf92f3577b34da6a3ce929d0e0e4736-" + "0" * 16 + "-01",  # all-zero span id
        "00_4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
    ],
)
def test_bad_input_is_ignored(bad: object) -> None:
    assert parse(bad) is None


def test_new_traces_and_children_are_valid_and_distinct() -> None:
    root = new_trace()
    child = root.child()
    assert re.match(PATTERN, root.header) and re.match(PATTERN, child.header)
    assert parse(root.header) == root and parse(child.header) == child
    assert child.trace_id == root.trace_id and child.span_id != root.span_id
    assert new_trace().trace_id != root.trace_id


def test_the_engine_link_carries_it_and_refuses_a_malformed_one() -> None:
    msg = AddSend(rank=0, request="r", prompt_len=4, block_ids=[[1]], traceparent=GOOD)
    got = decode(encode(msg))
    assert isinstance(got, AddSend) and got.traceparent == GOOD
    # An old engine that sends no traceparent is still understood.
    old = msgspec.msgpack.encode(
        {
            "type": "add_send",
            "version": PROTOCOL_VERSION,
            "rank": 0,
            "request": "r",
            "prompt_len": 4,
            "block_ids": [[1]],
        }
    )
    got = decode(old)
    assert isinstance(got, AddSend) and got.traceparent is None
    bad = AddSend(rank=0, request="r", prompt_len=4, block_ids=[[1]], traceparent="nope")
    with pytest.raises(ProtocolError, match="traceparent"):
        decode(encode(bad))
