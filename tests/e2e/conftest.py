"""Fixtures for end-to-end tests: real sidecars, engines and Mooncake, as separate processes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from app.sim.cluster import Cluster, ClusterSpec


@pytest.fixture
def make_cluster(tmp_path: Path) -> Iterator[object]:
    """Start clusters on demand; all are stopped at the end of the test."""
    started: list[Cluster] = []

    def make(**kw: object) -> Cluster:
        spec = ClusterSpec(log_dir=str(tmp_path), **kw)  # type: ignore[arg-type]
        cluster = Cluster(spec).__enter__()
        started.append(cluster)
        return cluster

    yield make
    for c in started:
        c.close()
