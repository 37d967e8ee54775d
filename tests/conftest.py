"""Shared fixtures and test settings."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

# The machine has two cores and other tests run real engines beside these: no deadlines.
settings.register_profile(
    "ci", deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
