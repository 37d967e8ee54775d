"""Every way a frame can fail to decode is a ProtocolError that says what came."""

from __future__ import annotations

import msgspec
import pytest

from app.errors import ProtocolError
from app.transfer.wire.codec import decode, encode
from app.transfer.wire.protocol import PROTOCOL_VERSION, Hello, Role

HELLO = msgspec.msgpack.decode(encode(Hello(compat_hash="c", engine_id="e", role=Role.PREFILL)))

# Each of these once escaped decode as something other than ProtocolError, or is a close cousin.
CASES = {
    "invalid utf-8 string": b"\xa1\xff",
    "invalid utf-8 in a map": b"\x81\xa4type\xa2\xc3\x28",
    "1001 nested arrays": b"\x91" * 1001 + b"\xc0",
    "100000 nested maps": b"\x81\xa1k" * 100_000 + b"\xc0",
    "nested inside a known message": msgspec.msgpack.encode(HELLO)[:-1] + b"\x91" * 5000,
    "truncated": encode(Hello(compat_hash="c", engine_id="e", role=Role.PREFILL))[:-3],
    "reserved opcode": b"\xc1",
    "empty": b"",
    "an ext type": b"\xd4\x01\x00",
    "a bare int": b"\x05",
    "map with array keys": b"\x81\x91\x01\x01",
    "bool version": msgspec.msgpack.encode({**HELLO, "version": True}),
    "huge int": b"\xcf" + b"\xff" * 8,
    "unknown tag": msgspec.msgpack.encode({"type": "x" * 5000, "version": PROTOCOL_VERSION}),
}


@pytest.mark.parametrize("frame", CASES.values(), ids=CASES.keys())
def test_any_decode_failure_is_a_protocol_error(frame: bytes) -> None:
    with pytest.raises(ProtocolError, match="malformed frame") as info:
        decode(frame)
    # The reason goes back to the sender and into the log: bounded whatever came.
    assert len(str(info.value)) < 600


def test_error_says_what_was_expected_and_what_came() -> None:
    with pytest.raises(ProtocolError) as info:
        decode(b"\xa1\xff" + b"z" * 1000)
    text = str(info.value)
    assert "expected a msgpack map whose 'type' names a message" in text
    # The size and the first bytes, not all thousand of them.
    assert "1002 bytes b'\\xa1\\xffzzz" in text and "z" * 100 not in text


def test_newer_version_is_named_not_its_fields() -> None:
    frame = msgspec.msgpack.encode({**HELLO, "version": PROTOCOL_VERSION + 1, "new_field": [1, 2]})
    with pytest.raises(
        ProtocolError, match=f"protocol version {PROTOCOL_VERSION + 1} is not supported"
    ):
        decode(frame)
