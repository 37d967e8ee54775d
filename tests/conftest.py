"""Shared fixtures and test settings."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from pydantic import SecretStr

from app.config import SidecarSettings
from app.harness.zygote import ENV as ZYGOTE_ENV

# Every vLLM API server the harness starts is forked from one zygote that imported vLLM once
# (app/harness/zygote.py): a pair starts in 23 s instead of 34 here. Set before anything starts
# an engine, and inherited by the benchmarks' child processes.
os.environ.setdefault(ZYGOTE_ENV, "1")

# The machine has two cores and other tests run real engines beside these: no deadlines.
settings.register_profile(
    "ci", deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


# Modules that start real vLLM engines. Starting one takes both cores for tens of seconds, so
# under ``pytest -n 2`` (scripts/test.sh) they run one after another on one worker while every
# other module, whole, runs on the other.
ENGINE_MODULES = ("tests/connectors/vllm/", "tests/chaos/test_real_engines.py")


def work_unit(nodeid: str) -> str:
    """What one xdist worker runs whole: all real-engine modules together, else the module."""
    module = nodeid.split("::", 1)[0]
    return "real-engines" if module.startswith(ENGINE_MODULES) else module


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # The engine modules first: the longest unit of work starts at once (a stable sort).
    items.sort(key=lambda item: work_unit(item.nodeid) != "real-engines")


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    # xdist's own loadgroup reads marks it can no longer attach on pytest 9 (node ids are
    # fixed), so scopes are named here: loadscope, with the engine modules as one scope.
    from xdist.scheduler import LoadScopeScheduling

    class EngineScopes(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    return EngineScopes(config, log)


@dataclass
class Clock:
    """Monotonic time the test moves by hand (a ``clock`` argument of the code under test)."""

    now: float = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


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


def one_rank_settings(
    role: str, engine_id: str, sockets: Path, admin_token: str | None = None
) -> SidecarSettings:
    """A one-rank sidecar on ports 0, its engine socket in ``sockets``, no engine yet: the
    admin API's own tests."""
    return SidecarSettings(
        role=role,
        engine_id=engine_id,
        ranks=[0],
        control_port=0,
        admin_port=0,
        engine_ipc=f"ipc://{sockets}/engine.sock",
        admin_token=SecretStr(admin_token) if admin_token is not None else None,
    )


def digested_bytes(admin_url: str) -> dict[str, float]:
    """``kvsidecar_kv_digest_bytes_total`` of one sidecar (its admin API), by side."""
    return counter_by(admin_url, "kvsidecar_kv_digest_bytes", "side")


def counter_by(admin_url: str, name: str, label: str) -> dict[str, float]:
    """Counter ``name`` of one sidecar (its admin API), summed by ``label``."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{admin_url}/metrics", timeout=10).text
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples if fam.name == name else ():
            if s.name.endswith("_total"):
                out[s.labels[label]] = out.get(s.labels[label], 0.0) + s.value
    return out
