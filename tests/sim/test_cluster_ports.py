"""The test cluster never guesses ports: its sidecars bind port 0 and report what they got."""

from __future__ import annotations

import socket
from pathlib import Path

import httpx

from app.sim.cluster import Cluster, ClusterSpec
from app.sim.rounds import summarize


def test_sidecars_bind_port_zero_and_report_their_ports(tmp_path: Path) -> None:
    # A port held by someone else is never chosen: the OS gives each listener a free one.
    squatter = socket.create_server(("127.0.0.1", 0))
    taken = squatter.getsockname()[1]
    cluster = Cluster(ClusterSpec(model="llama-3.1-8b", layers=2, log_dir=str(tmp_path)))
    try:
        with cluster:
            sides = list(cluster.sides.values())
            ports = [p for s in sides for p in (s.control_port, s.admin_port)]
            assert 0 not in ports and taken not in ports
            assert len(set(ports)) == len(ports)
            for side in sides:
                # What the engines were told (the advertised control port) is the bound one.
                assert all(rank["control_port"] == side.control_port for rank in side.info)
                assert httpx.get(f"{side.admin_url}/readyz", timeout=10).status_code == 200
                status = httpx.get(f"{side.admin_url}/v1/status", timeout=10).json()
                assert status["control_endpoint"] == f"tcp://127.0.0.1:{side.control_port}"
            pairs = cluster.make_requests([128])
            remote = pairs[0][0].remote
            assert remote is not None and remote.port == cluster.sides["decode"].control_port
            assert summarize(cluster.run(pairs), pairs)["verified"] == 1
            decode = cluster.sides["decode"]
            # A killed sidecar leaves its port file behind; its successor's ports replace it.
            cluster.kill_side(decode)
            assert cluster.port_file(decode).exists()
            cluster.start_side(decode)
            cluster.wait_ready(decode)
            status = httpx.get(f"{decode.admin_url}/v1/status", timeout=10).json()
            assert status["epoch"] == decode.info[0]["epoch"]
    finally:
        squatter.close()
