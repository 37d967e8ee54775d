#!/usr/bin/env bash
# Set up (idempotent), then lint, type-check and run the whole test suite (docs/testing.md).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
.venv/bin/ruff check app tests
.venv/bin/ruff format --check app tests
.venv/bin/mypy
# Everything without real vLLM engines on two workers, then the real-engine modules in one
# process: beside the other worker's tests the engines took twice as long (docs/testing.md).
t0=$SECONDS
.venv/bin/python -m pytest -q -n 2 --durations=20 --ignore=tests/connectors/vllm "$@"
echo "==== without engines: $(((SECONDS - t0) / 60))m$(((SECONDS - t0) % 60))s"
t0=$SECONDS
.venv/bin/python -m pytest -q --durations=20 tests/connectors/vllm "$@"
echo "==== tests/connectors/vllm: $(((SECONDS - t0) / 60))m$(((SECONDS - t0) % 60))s"
