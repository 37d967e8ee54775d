"""``kv-sidecar bench tables``: docs/benchmarks.md's marked tables made again from the committed
results they name (``app.bench.core.tables``); ``--check`` changes nothing and says which differ.

Each table kind is its bench's; this module names them all, as the core imports no bench."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from app.errors import ConfigError

if TYPE_CHECKING:
    from app.bench.core.tables import Render

DOC = Path(__file__).resolve().parents[2] / "docs" / "benchmarks.md"


def renders() -> dict[str, Render]:
    """Table kind (what a marker names) -> what renders it from a result."""
    from app.bench.chat_keys.tables import templates
    from app.bench.faults.tables import phases
    from app.bench.load.tables import full_length, shaped, shared, split, systems, target, tpot
    from app.bench.pool.tables import vs_direct
    from app.bench.routing.tables import policies
    from app.bench.scaling.tables import lengths
    from app.bench.soak.tables import growth
    from app.bench.turns.tables import store, store_forward, tails, with_loaded, without_loaded

    return {
        "chat-keys": templates,
        "faults": phases,
        "load-full-length": full_length,
        "load-shaped": shaped,
        "load-shared": shared,
        "load-split": split,
        "load-systems": systems,
        "load-target": target,
        "load-tpot": tpot,
        "pool-vs-direct": vs_direct,
        "routing": policies,
        "scaling": lengths,
        "soak": growth,
        "turns": without_loaded,
        "turns-loaded": with_loaded,
        "turns-store": store,
        "turns-store-forward": store_forward,
        "turns-tails": tails,
    }


def tables_command(
    doc: Annotated[Path, typer.Option(help="The Markdown file whose marked tables to make.")] = DOC,
    check: Annotated[
        bool,
        typer.Option(
            "--check", help="Change nothing; exit 1 naming each table its data differs from."
        ),
    ] = False,
) -> None:
    """Make every marked table of the document again from the JSON it names."""
    from app.bench.core.tables import differences, marked, regenerate

    if not doc.is_file():
        raise ConfigError(f"--doc {doc}: expected a Markdown file")
    text = doc.read_text()
    if check:
        found = differences(text, doc.parent, renders())
        for d in found:
            print(f"{doc}: {d}: differs from its data (kv-sidecar bench tables makes it again)")
        if found:
            raise typer.Exit(1)
        print(f"{doc}: {len(marked(text))} tables match their data")
        return
    new = regenerate(text, doc.parent, renders())
    if new != text:
        doc.write_text(new)
    print(f"{doc}: {len(marked(text))} tables made from their data")
