"""The test cluster survives losing its ports to another process between choice and bind."""

from __future__ import annotations

import socket
from pathlib import Path

import httpx

from app.sim.cluster import Cluster, ClusterSpec


def test_sidecar_that_lost_its_port_is_restarted_on_a_fresh_one(tmp_path: Path) -> None:
    squatter = socket.create_server(("127.0.0.1", 0))
    taken = squatter.getsockname()[1]
    cluster = Cluster(ClusterSpec(model="llama-3.1-8b", layers=2, log_dir=str(tmp_path)))
    cluster.sides["decode"].control_port = taken
    try:
        with cluster:
            decode = cluster.sides["decode"]
            assert decode.control_port != taken
            assert all(rank["control_port"] == decode.control_port for rank in decode.info)
            assert httpx.get(f"{decode.admin_url}/readyz").status_code == 200
        log = (tmp_path / "decode-sidecar.log").read_text()
        assert f"cannot bind tcp://127.0.0.1:{taken}" in log
    finally:
        squatter.close()
