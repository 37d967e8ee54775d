#!/usr/bin/env bash
# Set up (idempotent), then lint, type-check and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
.venv/bin/ruff check app tests
.venv/bin/ruff format --check app tests
.venv/bin/mypy
# Two workers: the real-engine modules one after another on one, the rest on the other
# (tests/conftest.py schedules them; README "Tests").
.venv/bin/python -m pytest -q -n 2 "$@"
