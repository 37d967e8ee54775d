"""``bench soak``'s result as docs/benchmarks.md shows it: a row per process, what it held at
the baseline, late in the run and at most."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from app.bench.core.tables import Table, num

PROCESSES = (
    ("sidecar-prefill", "prefill's sidecar"),
    ("sidecar-decode", "decode's sidecar"),
    ("proxy", "proxy"),
)
HEADER = (
    "process",
    "RSS MiB: baseline → late (highest)",
    "fds: baseline → late (highest)",
    "threads",
)


def growth(result: Mapping[str, Any]) -> Table:
    g = result["growth"]

    def rss(p: str) -> str:
        r = g[f"{p}/rss_mib"]
        return (
            f"{num(r['base'], 1)} → {num(r['late'], 1)} ({num(r['max'], 1)}): "
            f"{num(r['ratio'], 3)} ×"
        )

    def fds(p: str) -> str:
        r = g[f"{p}/fds"]
        return f"{r['base']:g} → {r['late']:g} ({r['max']:g})"

    def threads(p: str) -> str:
        r = g[f"{p}/threads"]
        return f"{r['base']:g} → {r['late']:g}"

    rows = tuple((label, rss(p), fds(p), threads(p)) for p, label in PROCESSES)
    return Table(HEADER, rows)
