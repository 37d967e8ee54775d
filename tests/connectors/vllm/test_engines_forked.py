"""The harness forks every engine's API server from one zygote (app/harness/zygote.py): the
15 s import of vLLM's server, once per test session instead of once per engine start."""

from __future__ import annotations

import os

from app.harness.local_pd import LocalPD
from app.harness.proc_tree import proc_stat
from app.harness.zygote import ENV, ZygoteChild


def parent(pid: int) -> int:
    stat = proc_stat(pid)
    assert stat is not None, f"process {pid} is gone"
    return stat[0]


def test_the_pairs_api_servers_are_forked_from_one_zygote(llama_pd: LocalPD) -> None:
    assert os.environ.get(ENV) == "1"  # tests/conftest.py
    servers = [llama_pd.procs[f"vllm-{inst.name}"] for inst in llama_pd.instances]
    assert all(isinstance(s, ZygoteChild) and s.poll() is None for s in servers)
    parents = {parent(s.pid) for s in servers}
    assert len(parents) == 1 and parents != {os.getpid()}
