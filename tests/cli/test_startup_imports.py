"""Starting ``kv-sidecar`` imports only what the command needs.

Every sidecar and proxy the tests, the benches and a deployment start runs ``python -m app ...``;
torch costs 2-3 s of a core per start on these machines, and the proxy and the CLI's parsing
need none of it (the sidecar imports it when it serves)."""

from __future__ import annotations

import json
import subprocess
import sys


def heavy_modules_after(code: str) -> list[str]:
    probe = (
        "HEAVY = {'torch', 'vllm', 'mooncake'}\n"
        f"{code}\nimport json, sys\n"
        "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules} & HEAVY)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True
    )
    return list(json.loads(out.stdout))


def test_the_command_line_parses_without_torch() -> None:
    assert heavy_modules_after("import app.cli.main") == []


def test_the_proxy_starts_without_torch() -> None:
    assert heavy_modules_after("import app.cli.main, app.proxy.app") == []
