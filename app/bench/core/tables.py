"""Markdown tables made from the committed results (``docs/bench/*.json``), and the places in a
document they stand: a marker line ``<!-- table KIND bench/FILE.json -->`` right above a table
says that the table is KIND's rendering of that file (relative to the document). ``regenerate``
puts every marked table back from its file; ``kv-sidecar bench tables`` runs it on
docs/benchmarks.md, and its ``--check`` is what tests/bench/test_tables.py holds the committed
document to. What renders each KIND is its bench's (``app.bench.<bench>.tables``): the command
names them, as the core imports no bench."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.errors import BenchError

MARKER = re.compile(r"^<!-- table (?P<kind>[\w-]+) (?P<file>\S+\.json) -->$")
MINUS = "\u2212"  # the docs write negative figures with a minus sign, not a hyphen


@dataclass(frozen=True)
class Table:
    """A header, each column's alignment (``"---"`` or ``"---:"``) and the rows, as text."""

    header: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]
    align: tuple[str, ...] = ()

    def lines(self) -> list[str]:
        align = self.align or ("---",) * len(self.header)
        for row in (align, *self.rows):
            if len(row) != len(self.header):
                raise BenchError(
                    f"a table row has {len(self.header)} cells like its header "
                    f"{self.header}, got {len(row)}: {row}"
                )
        header = f"| {' | '.join(self.header)} |".replace("|  |", "| |")  # an empty first cell
        return [header, f"|{'|'.join(align)}|", *(f"| {' | '.join(r)} |" for r in self.rows)]


Render = Callable[[Mapping[str, Any]], Table]


@dataclass(frozen=True)
class Marked:
    """One marked table of a document: its marker's line (1-based), kind and file."""

    line: int
    kind: str
    file: str


def marked(text: str) -> list[Marked]:
    out = []
    for i, line in enumerate(text.splitlines(), 1):
        m = MARKER.match(line)
        if m is not None:
            out.append(Marked(i, m["kind"], m["file"]))
    return out


def regenerate(text: str, base: Path, renders: Mapping[str, Render]) -> str:
    """``text`` with every marked table replaced by its kind's rendering of its file (the
    table: the ``|`` lines right after the marker; none there yet: it is put in)."""
    lines = text.splitlines()
    out: list[str] = []
    i = 0
    while i < len(lines):
        out.append(lines[i])
        m = MARKER.match(lines[i])
        i += 1
        if m is None:
            continue
        render = renders.get(m["kind"])
        if render is None:
            raise BenchError(
                f"line {i}: a table of kind {m['kind']!r}, expected one of {sorted(renders)}"
            )
        path = base / m["file"]
        if not path.is_file():
            raise BenchError(f"line {i}: the table's data {path} is not there")
        out += render(json.loads(path.read_text())).lines()
        while i < len(lines) and lines[i].startswith("|"):
            i += 1
    return "\n".join(out) + ("\n" if text.endswith("\n") else "")


def differences(text: str, base: Path, renders: Mapping[str, Render]) -> list[str]:
    """The marked tables of ``text`` that differ from what their files give, as ``line N: KIND
    FILE`` (the marker's line); [] when every one matches."""
    old_lines = text.splitlines()
    new_lines = regenerate(text, base, renders).splitlines()
    # The markers keep their order and a table only ever changes size: pair them in order.
    return [
        f"line {m.line}: {m.kind} {m.file}"
        for m, n in zip(marked(text), marked("\n".join(new_lines)), strict=True)
        if _table(old_lines, m.line) != _table(new_lines, n.line)
    ]


def _table(lines: Sequence[str], marker_line: int) -> list[str]:
    """The ``|`` lines right after the marker on ``marker_line`` (1-based)."""
    out = []
    for line in lines[marker_line:]:
        if not line.startswith("|"):
            break
        out.append(line)
    return out


# ---- cells ---------------------------------------------------------------------------------


def num(v: float, digits: int = 0) -> str:
    """``v`` with ``digits`` decimals, a minus sign for negatives."""
    text = f"{v:.{digits}f}"
    return MINUS + text[1:] if text.startswith("-") else text


def grouped(v: int) -> str:
    """``131072`` -> ``131,072``."""
    return f"{v:,}"


def mib(n_bytes: float) -> str:
    """A size in MiB, or in GiB from 1 GiB, without decimals where whole."""
    if n_bytes >= 1 << 30:
        return f"{n_bytes / (1 << 30):g} GiB"
    if n_bytes >= 1 << 20:
        return f"{n_bytes / (1 << 20):g} MiB"
    return f"{n_bytes / (1 << 10):g} KiB"
