"""A sidecar process with faults hooked in, for the e2e tests: ``python -m
tests.e2e.fault_sidecar --fail-writes N`` serves like ``kv-sidecar serve`` (settings from the
environment) but its Mooncake engine fails its first N write calls."""

from __future__ import annotations

import argparse
import asyncio
import sys

from app.config import load_settings
from app.service import serve
from app.transfer.lanes.mooncake import MooncakeEngine


def command(*, fail_writes: int) -> list[str]:
    """The argv that starts this launcher (for ``ClusterSpec.sidecar_cmd``)."""
    return [sys.executable, "-m", __name__, "--fail-writes", str(fail_writes)]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fail-writes", type=int, default=0)
    args = parser.parse_args()

    def hook(engine: MooncakeEngine) -> None:
        engine.inject_failures(args.fail_writes)

    return asyncio.run(serve(load_settings({}, None), engine_hook=hook))


if __name__ == "__main__":
    raise SystemExit(main())
