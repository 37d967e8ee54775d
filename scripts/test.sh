#!/usr/bin/env bash
# Set up (idempotent), then lint, type-check and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
.venv/bin/ruff check app tests
.venv/bin/ruff format --check app tests
.venv/bin/mypy
.venv/bin/python -m pytest -q "$@"
