"""``bench pd`` in a network namespace of its own (``core.netns``): ``python -m
app.bench.pd.bench OPTIONS.json`` runs there and writes ``pd.json``."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

from app.bench.core.netns import run_child
from app.bench.pd.bench import PDOptions

CHILD = ("-m", "app.bench.pd.bench")  # what runs in the namespace (tests swap it)


def run_in_namespace(opts: PDOptions) -> dict[str, Any]:
    """Create the namespace, run ``pd.bench`` in it, remove it; the run's result."""
    return run_child(CHILD, asdict(opts), Path(opts.out), "pd.json", opts.regime)
