#!/usr/bin/env bash
# Set up (idempotent), then run the main job with any extra flags passed through.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
exec .venv/bin/kv-sidecar demo "$@"
