#!/usr/bin/env bash
# Set up (idempotent), then lint, type-check and run the whole test suite (docs/testing.md).
# Each part prints its wall time.
set -euo pipefail
cd "$(dirname "$0")/.."
timed() {
  local name=$1 t0=$SECONDS
  shift
  "$@"
  echo "==== ${name}: $(((SECONDS - t0) / 60))m$(((SECONDS - t0) % 60))s"
}
timed "set-up" ./scripts/setup.sh
timed "ruff" bash -c '.venv/bin/ruff check app tests && .venv/bin/ruff format --check app tests'
# mypy's incremental cache outside the checkout (it keys modules by name and content hash, so it
# serves any clone): 1:44 cold on a fresh machine, seconds after.
export MYPY_CACHE_DIR="${MYPY_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/kv-sidecar/mypy}"
timed "mypy" .venv/bin/mypy
# Everything without real vLLM engines on two workers, then the real-engine modules in one
# process: beside the other worker's tests the engines took twice as long (docs/testing.md).
timed "without engines" .venv/bin/python -m pytest -q -n 2 --durations=20 \
  --ignore=tests/connectors/vllm "$@"
timed "tests/connectors/vllm" .venv/bin/python -m pytest -q --durations=20 tests/connectors/vllm "$@"
