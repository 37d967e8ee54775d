#!/usr/bin/env bash
# Set up (idempotent), then lint, type-check and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
.venv/bin/ruff check app tests
.venv/bin/ruff format --check app tests
.venv/bin/mypy
# Everything without real vLLM engines on two workers, then the real-engine modules in one
# process: beside the other worker's tests the engines took twice as long (README "Tests").
.venv/bin/python -m pytest -q -n 2 --ignore=tests/connectors/vllm "$@"
.venv/bin/python -m pytest -q tests/connectors/vllm "$@"
