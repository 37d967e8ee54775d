"""Our transfer metrics as vLLM's own ``/metrics`` shows them (``app/connectors/vllm/stats.py``)."""

from __future__ import annotations

import re
import time

import httpx

NAMES = {
    "transfers": "vllm:kv_sidecar_transfers_total",
    "failed": "vllm:kv_sidecar_failed_transfers_total",
    "expired": "vllm:kv_sidecar_expired_transfers_total",
    "bytes": "vllm:kv_sidecar_bytes_transferred_total",
    "time_count": "vllm:kv_sidecar_transfer_time_seconds_count",
    "time_sum": "vllm:kv_sidecar_transfer_time_seconds_sum",
}


def sample(text: str, name: str, direction: str) -> float:
    """The value of ``name`` for ``direction``, summed over its other labels (0 if absent)."""
    total = 0.0
    for m in re.finditer(rf"^{re.escape(name)}\{{([^}}]*)\}} (\S+)$", text, re.M):
        if f'direction="{direction}"' in m.group(1):
            total += float(m.group(2))
    return total


def metrics(base: str) -> dict[str, float]:
    """Our metrics off an engine's vLLM ``/metrics``, by short name and direction."""
    text = httpx.get(f"{base}/metrics", timeout=10).text
    for name in NAMES.values():
        assert name in text, f"{name} missing from {base}/metrics"
    return {
        f"{key}/{d}": sample(text, name, d) for key, name in NAMES.items() for d in ("send", "recv")
    }


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in after}


def wait_counted(
    base: str, before: dict[str, float], key: str, timeout_s: float = 60
) -> dict[str, float]:
    """The metrics' change since ``before`` once ``key`` moved (stats arrive with engine steps)."""
    end = time.monotonic() + timeout_s
    while True:
        d = delta(metrics(base), before)
        if d[key] > 0 or time.monotonic() > end:
            return d
        time.sleep(0.2)
