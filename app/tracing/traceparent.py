"""The W3C ``traceparent`` header (https://www.w3.org/TR/trace-context/), parsed and made.

Pure code, no OpenTelemetry: the header is carried and recorded without it. A header that
does not parse is ignored (``parse`` returns None), as the W3C spec asks of a receiver: the
request goes on and the proxy starts a new trace for it.
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass

HEADER = "traceparent"
# version 00 is exactly this; later versions may append "-..." fields, which we drop.
_V00 = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")
PATTERN = r"^00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$"
"""What this project sends and accepts on its own wire (the version it writes)."""

_ZERO_TRACE = "0" * 32
_ZERO_SPAN = "0" * 16
SAMPLED = 0x01


@dataclass(frozen=True)
class TraceParent:
    """One span's context: its trace, its own id (the parent of whatever it is passed to)."""

    trace_id: str  # 32 lowercase hex, not all zero
    span_id: str  # 16 lowercase hex, not all zero
    flags: int = SAMPLED

    @property
    def sampled(self) -> bool:
        return bool(self.flags & SAMPLED)

    @property
    def header(self) -> str:
        return f"00-{self.trace_id}-{self.span_id}-{self.flags:02x}"

    def child(self) -> TraceParent:
        """A new span id in the same trace (what a span made under this one passes on)."""
        return TraceParent(self.trace_id, new_span_id(), self.flags)


def new_span_id() -> str:
    while (span := secrets.token_hex(8)) == _ZERO_SPAN:
        pass
    return span


def new_trace() -> TraceParent:
    """The root of a new, sampled trace."""
    while (trace := secrets.token_hex(16)) == _ZERO_TRACE:
        pass
    return TraceParent(trace, new_span_id())


def parse(value: object) -> TraceParent | None:
    """``value`` as a traceparent, or None when it is not one (wrong type, length, case,
    version ``ff``, all-zero ids, or a version-00 header with trailing fields)."""
    if not isinstance(value, str) or len(value) < 55:
        return None
    m = _V00.fullmatch(value[:55])
    if m is None:
        return None
    version, trace, span, flags = m.groups()
    if version == "ff" or trace == _ZERO_TRACE or span == _ZERO_SPAN:
        return None
    # Version 00 has exactly four fields; a later version may add more after a dash.
    if len(value) > 55 and (version == "00" or value[55] != "-"):
        return None
    return TraceParent(trace, span, int(flags, 16))
