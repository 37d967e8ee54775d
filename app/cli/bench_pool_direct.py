"""``kv-sidecar bench pool-vs-direct``: the next turn's history through the KV pool or written
straight from decode into prefill's blocks, the same bytes on real Mooncake."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from app.errors import ConfigError


def pool_direct_command(
    object_kib: Annotated[
        str, typer.Option(help="Object (block) sizes in KiB, comma-separated.")
    ] = "512,8192",
    total_mib: Annotated[int, typer.Option(help="History bytes moved per rep, MiB.")] = 64,
    reps: Annotated[int, typer.Option(help="Reps per way, alternating.")] = 10,
    out: Annotated[Path, typer.Option(help="Where to write the JSON.")] = Path(
        "pool-vs-direct.json"
    ),
) -> None:
    """Pool load against a direct write of the same bytes, with each way's A/A floor."""
    try:
        sizes = tuple(int(x) << 10 for x in object_kib.split(","))
    except ValueError as e:
        raise ConfigError(
            f"--object-kib {object_kib!r}: expected KiB numbers, e.g. 512,8192"
        ) from e
    total = total_mib << 20
    if any(s <= 0 or total % s for s in sizes):
        raise ConfigError(
            f"--object-kib {object_kib}: each size must divide --total-mib {total_mib}"
        )
    from app.bench.core.host import LOOPBACK, host_record
    from app.bench.core.result_file import print_host, write_result
    from app.bench.pool.vs_direct import PoolVsDirectOptions, run

    result = run(PoolVsDirectOptions(sizes, total, reps))
    table = Table(
        "object", "objects", "pool load ms", "direct ms", "pool / direct", "A/A pool", "A/A direct"
    )
    for r in result["rows"]:
        table.add_row(
            f"{r['object_bytes'] >> 10} KiB",
            str(r["objects"]),
            _ms(r["pool_load_ms"]),
            _ms(r["direct_ms"]),
            f"{r['pool_over_direct']:.2f}",
            f"{r['aa_pool']:.2f}",
            f"{r['aa_direct']:.2f}",
        )
    console = Console()
    console.print(table)
    host = host_record(engines={}, link=LOOPBACK)  # Mooncake's processes, no vLLM engine
    write_result(out, result, host)
    print_host(host, console)
    console.print(f"wrote {out}")


def _ms(s: dict[str, float]) -> str:
    return f"{s['median']:.1f} ({s['min']:.1f}-{s['max']:.1f})"
