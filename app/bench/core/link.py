"""The link between P and D inside a bench's network namespace: loopback shaped by a token
bucket (``tc ... tbf``) or not, and the calibration that chose the rate, as text."""

from __future__ import annotations

import subprocess
from typing import Any

from app.bench.core.stats import default_burst


def set_link(
    rate_bps: float | None, burst: int | None = None, latency_ms: int = 100
) -> dict[str, Any]:
    """Shape loopback (a token bucket) or take the shaping off; we are inside the namespace."""
    subprocess.run(["tc", "qdisc", "del", "dev", "lo", "root"], capture_output=True, check=False)
    if rate_bps is None:
        return {"link": "unshaped"}
    burst = burst or default_burst(rate_bps)
    cmd = ["tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate", f"{int(rate_bps)}bit"]
    cmd += ["burst", str(burst), "latency", f"{latency_ms}ms"]
    subprocess.run(cmd, check=True)
    print(f"shaped loopback: {' '.join(cmd)}", flush=True)
    return {
        "link": "shaped",
        "rate_bps": rate_bps,
        "burst": burst,
        "latency_ms": latency_ms,
        "tc": cmd,
    }


def calibration_text(cal: dict[str, Any]) -> str:
    share = cal["share"]
    lines = [f"calibration (unshaped): rate = bytes*8 / ({share} * P prefill s), median of:"]
    for w, v in cal["per_workload"].items():
        mbit = v["rate_bps"] / 1e6
        lines.append(
            f"  {w}: {v['bytes']:.0f} B * 8 / ({share} * {v['prefill_s']:.3f} s)"
            f" = {mbit:.1f} Mbit/s"
        )
    lines.append(f"  -> rate {cal['rate_bps'] / 1e6:.1f} Mbit/s")
    return "\n".join(lines)
