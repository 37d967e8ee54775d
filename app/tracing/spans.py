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


def wall_ns(monotonic_s: float, *, now_ns: int | None = None, mono_ns: int | None = None) -> int:
    """A ``time.monotonic()`` reading as Unix nanoseconds (what OTLP carries), through the
    offset between the two clocks now; spans of one process keep their order exactly."""
    now = time.time_ns() if now_ns is None else now_ns
    mono = time.monotonic_ns() if mono_ns is None else mono_ns
    return now - mono + round(monotonic_s * 1e9)
