"""Spans recorded after the fact (pure data): what a sidecar knows of a transfer once it
ended, with the times it measured on its own monotonic clock."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field

Attribute = str | int | float | bool


@dataclass(frozen=True)
class SpanRecord:
    """One span to emit: ``start``/``end`` are ``time.monotonic()`` seconds; ``children`` are
    emitted as its child spans; ``error`` marks it failed with that description."""

    name: str
    start: float
    end: float
    attributes: Mapping[str, Attribute] = field(default_factory=dict)
    children: tuple[SpanRecord, ...] = ()
    error: str | None = None


def clock_offset_ns() -> int:
    """Unix time minus ``time.monotonic()``, now, in nanoseconds."""
    return time.time_ns() - time.monotonic_ns()


def wall_ns(monotonic_s: float, offset_ns: int) -> int:
    """A ``time.monotonic()`` reading as Unix nanoseconds (what OTLP carries). One offset for
    all spans of an emission keeps their order exactly."""
    return offset_ns + round(monotonic_s * 1e9)
