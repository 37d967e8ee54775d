"""Interleaved runs of side-by-side benches (issue 52, item 2): the systems in alternating
blocks, so that drift of the host (other work, thermal state, page cache) between the start and
the end of a run falls on every system alike instead of on whichever ran last.

A round visits every system once; even rounds in the given order, odd rounds reversed: two
systems run A B B A, three A B C C B A. Every system's rounds then sit at the same mean position
in time, and two rounds of one system are its A/A: the same work, measured apart in time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from app.errors import ConfigError

MIN_ROUNDS = 2  # an A/A needs two rounds of one system


@dataclass(frozen=True)
class Block:
    """One system's ``round``-th run (0-based) in the schedule."""

    system: str
    round: int


def abba(systems: Sequence[str], rounds: int) -> list[Block]:
    """The blocks in run order: ``rounds`` rounds of ``systems``, every other one reversed."""
    if not systems:
        raise ConfigError("an interleaved run needs at least one system, got none")
    if len(set(systems)) != len(systems):
        raise ConfigError(f"each system once in an interleaved run, got {list(systems)}")
    if rounds < MIN_ROUNDS:
        raise ConfigError(f"rounds must be at least {MIN_ROUNDS} (the A/A), got {rounds}")
    out = []
    for r in range(rounds):
        order = systems if r % 2 == 0 else list(reversed(systems))
        out += [Block(name, r) for name in order]
    return out


def mean_position(blocks: Sequence[Block], system: str) -> float:
    """Where ``system`` sits in the run on average (0: first block): equal for every system of
    an even number of rounds."""
    at = [i for i, b in enumerate(blocks) if b.system == system]
    if not at:
        raise ConfigError(f"{system!r} is not in the schedule")
    return sum(at) / len(at)


def aa_name(system: str) -> str:
    return f"{system}-aa"
