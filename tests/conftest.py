"""Shared fixtures and test settings."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

# The machine has two cores and other tests run real engines beside these: no deadlines.
settings.register_profile(
    "ci", deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def wait_for(
    what: str, fn: Callable[[], Any], timeout_s: float = 20.0, interval_s: float = 0.05
) -> Any:
    """Poll ``fn`` until it returns something truthy; fail the test after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        last = fn()
        if last:
            return last
        time.sleep(interval_s)
    pytest.fail(f"timed out after {timeout_s:g}s waiting for {what} (last: {last!r})")
