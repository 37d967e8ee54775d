"""Frames of the wire messages (``protocol``): msgpack, tagged. Never pickle. A frame that does
not decode, or decodes to an unknown version, is a ``ProtocolError`` that says what was wrong."""

from __future__ import annotations

from typing import get_args

import msgspec

from app.errors import ProtocolError
from app.transfer.wire.protocol import PROTOCOL_VERSION, AnyMsg, Msg

# What a frame shows of itself in an error: enough to recognise it, not enough to flood a log.
_SHOWN_BYTES = 32
_SHOWN_REASON = 300

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(AnyMsg)
_TAGS = frozenset(str(t.__struct_config__.tag) for t in get_args(AnyMsg))


def encode(msg: Msg) -> bytes:
    return _encoder.encode(msg)


def decode(frame: bytes) -> AnyMsg:
    """Decode one frame; any failure is a ProtocolError that says what was wrong with it.

    Hostile bytes reach msgspec and Python in more ways than ``DecodeError`` (invalid UTF-8 is a
    ``UnicodeDecodeError``, deep nesting a ``RecursionError``), and every one of them must stay
    a counted rejection in the caller, never an escape from its error path.
    """
    try:
        msg = _decoder.decode(frame)
    except Exception as e:
        raise _malformed(frame, e) from None
    if msg.version != PROTOCOL_VERSION:
        raise _unsupported(msg.version)
    return msg


def describe(frame: bytes) -> str:
    """A frame as an error shows it: its size and its first bytes."""
    more = "..." if len(frame) > _SHOWN_BYTES else ""
    return f"{len(frame)} bytes {frame[:_SHOWN_BYTES]!r}{more}"


def _malformed(frame: bytes, e: Exception) -> ProtocolError:
    # msgspec echoes offending values (an unknown tag, a long string): keep the reply small.
    text = str(e) or type(e).__name__
    if not isinstance(e, (msgspec.DecodeError, msgspec.ValidationError)):
        text = f"{type(e).__name__}: {text}"
    if len(text) > _SHOWN_REASON:
        text = text[:_SHOWN_REASON] + "..."
    try:
        raw = msgspec.msgpack.decode(frame)
    except Exception:  # the same hostile bytes that failed the typed decode
        raw = None
    fields = raw if isinstance(raw, dict) else {}
    version, tag = fields.get("version"), fields.get("type")
    # A newer peer's message may not fit our structs: name the version, not the field.
    if isinstance(version, int) and not isinstance(version, bool) and version != PROTOCOL_VERSION:
        return _unsupported(version)
    if isinstance(e, msgspec.ValidationError) and isinstance(tag, str) and tag in _TAGS:
        return ProtocolError(f"malformed frame: invalid {tag!r} message: {text}")
    return ProtocolError(
        f"malformed frame: expected a msgpack map whose 'type' names a message, got "
        f"{describe(frame)}: {text}"
    )


def _unsupported(version: object) -> ProtocolError:
    return ProtocolError(
        f"protocol version {repr(version)[:40]} is not supported; this sidecar speaks "
        f"{PROTOCOL_VERSION}"
    )
