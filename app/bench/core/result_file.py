"""The one way a bench writes its result: as JSON, with the host it was measured on.

Every bench (``app/bench``, ``app/cli/bench*``) writes its result file and its ``--json`` output
here, so none can leave the host out (tests/bench/core/test_host_record.py holds every other
``json.dump`` in them to a short list of files that are no results).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console

from app.bench.core.host import HostRecord
from app.errors import BenchError

HOST = "host"


def with_host(payload: Mapping[str, Any], host: HostRecord) -> dict[str, Any]:
    """``payload`` and its host, as written; a payload must not bring a host of its own."""
    if HOST in payload:
        raise BenchError(f"a result's payload has no '{HOST}' key (it is added here), got one")
    return {**payload, HOST: host.as_dict()}


def write_result(
    path: Path, payload: Mapping[str, Any], host: HostRecord, indent: int | None = 1
) -> dict[str, Any]:
    """Write ``payload`` with ``host`` to ``path``; what was written."""
    record = with_host(payload, host)
    path.write_text(json.dumps(record, indent=indent) + "\n")
    return record


def split_host(record: Mapping[str, Any]) -> tuple[dict[str, Any], HostRecord]:
    """A written result (a bench's child process wrote it) back into payload and host."""
    if HOST not in record:
        raise BenchError(f"a bench result carries '{HOST}', got the keys {sorted(record)}")
    payload = {k: v for k, v in record.items() if k != HOST}
    return payload, HostRecord.from_dict(record[HOST])


def result_json(record: Mapping[str, Any], keys: Sequence[str] | None = None) -> str:
    """A written result as ``--json`` prints it: ``keys`` of it (None: all), with its host."""
    if HOST not in record:
        raise BenchError(f"print a written result (with '{HOST}'), got the keys {sorted(record)}")
    chosen = record if keys is None else {k: record[k] for k in (*keys, HOST)}
    return json.dumps(chosen)


def print_host(host: HostRecord, console: Console) -> None:
    # Engine flags hold brackets (connector JSON): not rich markup.
    for line in host.lines():
        console.print(line, markup=False, highlight=False, soft_wrap=True)
