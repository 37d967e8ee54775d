"""``kv-sidecar``: the command line (typer).

Each command imports its heavy modules (torch, the benches, the simulator) inside its function:
every sidecar and proxy start parses this whole CLI, and torch alone is 2-3 s of a core there
(tests/cli/test_startup_imports.py holds it)."""

from __future__ import annotations

import sys

import typer

from app.cli.bench import bench_app
from app.cli.demo import demo_command
from app.cli.plan import plan_command
from app.cli.proxy import proxy_command
from app.cli.serve import serve_command
from app.errors import KVSidecarError

app = typer.Typer(
    name="kv-sidecar",
    help="Layer-wise KV cache transfer for hybrid-attention LLMs on Mooncake.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
app.add_typer(bench_app, name="bench")
app.command("demo")(demo_command)
app.command("plan")(plan_command)
app.command("proxy")(proxy_command)
app.command("serve")(serve_command)


@app.callback()
def _root() -> None:
    """Layer-wise KV cache transfer for hybrid-attention LLMs on Mooncake."""


def main() -> None:
    """Console entry point: known errors exit 2 with one sentence, never a traceback."""
    try:
        app()
    except KVSidecarError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
