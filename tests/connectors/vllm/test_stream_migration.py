"""A decode SIGKILLed mid-stream: the proxy resumes the stream on the other decode with the
prompt plus the tokens already streamed (issue 53 item 3, app/proxy/migration.py).

One prefill and two decodes behind the proxy (its default ``--migration-limit 1``), the deep
tiny Llama in float32 (as ``llama_pd``: in bfloat16 a batch's rounding can flip a near-tied
greedy token of the random model). A greedy streamed request is first answered unbroken; the
same request again has its decode frozen after its first few events and killed. The client's
stream completes without an error event, and its token ids, finish reason and usage equal the
unbroken answer's.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from app.harness.local_pd import LocalPD
from app.harness.proc_tree import process_tree, signal_all
from app.harness.tiny_models import write_tiny_model
from tests.conftest import wait_for
from tests.connectors.vllm.conftest import DEEP_LLAMA, engines_up, prompt

pytestmark = pytest.mark.slow_engines

LENGTH = 300
MAX_TOKENS = 48
KILL_AFTER = 3  # token events the client has when its decode is frozen and killed


@pytest.fixture(scope="module")
def p1d2(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalPD]:
    root = tmp_path_factory.mktemp("migration")
    model = write_tiny_model(root / "model", "llama", overrides=DEEP_LLAMA)
    stack = LocalPD(
        model,
        root / "run",
        recv_timeout_s=15.0,
        kind="llama",
        decodes=2,
        prefill_prefix_caching=True,  # the continuation's prefill computes only what is new
        extra_vllm_args=("--dtype", "float32"),
    )
    with engines_up(stack):
        yield stack


def _body(tokens: list[int]) -> dict[str, Any]:
    return {
        "model": "tiny",
        "prompt": tokens,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


class Stream:
    """A streamed completion read event by event: token ids, finish reason, usage, errors."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.events: list[dict[str, Any]] = []
        self.errors: list[Any] = []
        self.finish: str | None = None
        self.usage: dict[str, Any] | None = None
        self.done = False
        self.ids: set[str] = set()

    def take(self, line: str) -> None:
        if not line.startswith("data: "):
            return
        if line == "data: [DONE]":
            self.done = True
            return
        event = json.loads(line[6:])
        self.events.append(event)
        if "error" in event:
            self.errors.append(event["error"])
            return
        self.ids.add(event["id"])
        for ch in event.get("choices") or []:
            self.tokens.extend(ch.get("token_ids") or [])
            self.finish = ch.get("finish_reason") or self.finish
        if event.get("usage"):
            self.usage = event["usage"]


def _unbroken(proxy: str, tokens: list[int]) -> tuple[Stream, float]:
    s, t0 = Stream(), time.monotonic()
    with httpx.stream("POST", f"{proxy}/v1/completions", json=_body(tokens), timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            s.take(line)
    return s, time.monotonic() - t0


def _records(proxy: str) -> dict[str, dict[str, Any]]:
    got = httpx.get(f"{proxy}/v1/transfers", params={"limit": 50}, timeout=10).json()
    return {r["transfer_id"]: r for r in got["transfers"]}


def test_a_greedy_stream_survives_its_decode_killed(p1d2: LocalPD) -> None:
    pd = p1d2
    tokens = prompt(LENGTH, 4242)
    _unbroken(pd.proxy, tokens)  # warm: both answers below then run on warm engines
    want, unbroken_s = _unbroken(pd.proxy, tokens)
    assert want.done and len(want.tokens) == MAX_TOKENS and not want.errors

    got, t0 = Stream(), time.monotonic()
    killed_at = resumed_in = None
    at = 0
    with httpx.stream("POST", f"{pd.proxy}/v1/completions", json=_body(tokens), timeout=120) as r:
        assert r.status_code == 200
        tid = r.headers["x-kv-transfer-id"]
        url = _records(pd.proxy)[tid]["decode"]
        (victim,) = [d for d in pd.decode_instances if d.url == url]
        pids = process_tree(pd.procs[f"vllm-{victim.name}"].pid)
        lines = r.iter_lines()
        for line in lines:
            got.take(line)
            if killed_at is None and len(got.tokens) >= KILL_AFTER:
                # Frozen first: nothing more leaves it while the kill reaps its processes.
                signal_all(pids, signal.SIGSTOP)
                at, frozen_at = len(got.tokens), time.monotonic()
                pd.kill(f"vllm-{victim.name}")
                killed_at = time.monotonic()
            elif killed_at is not None and resumed_in is None and got.tokens[at:]:
                resumed_in = time.monotonic() - killed_at
    total_s = time.monotonic() - t0
    assert killed_at is not None and at < MAX_TOKENS, "the answer ended before the kill"

    assert got.errors == [] and got.done
    assert got.tokens == want.tokens  # nothing sent twice, nothing missing
    assert got.finish == want.finish == "length"
    assert got.usage == want.usage and got.usage is not None
    assert (got.usage["prompt_tokens"], got.usage["completion_tokens"]) == (LENGTH, MAX_TOKENS)
    assert len(got.ids) == 1  # one stream id, the continuation's events rewritten to it

    def settled() -> dict[str, Any] | None:
        records = _records(pd.proxy)
        nxt = records[tid].get("retried_as")
        return records if nxt and records[nxt]["status"] != "pending" else None

    records = wait_for("the continuation's record", settled, 10)
    broken, cont = records[tid], records[records[tid]["retried_as"]]
    assert broken["status"] == "decode_failed" and broken["decode"] == victim.url, broken
    assert cont["migrated_from"] == victim.url and cont["decode"] != victim.url, cont
    # The client may have read past ``at`` before the freeze landed: counted from what the
    # proxy had relayed.
    assert at <= cont["migrated_at_token"] < MAX_TOKENS, cont
    assert cont["retries"][-1]["reason"] == "mid_stream" and cont["attempts"] == 2, cont
    metrics = httpx.get(f"{pd.proxy}/metrics", timeout=10).text
    assert 'kvproxy_migrations_total{outcome="resumed"} 1.0' in metrics
    # The test's own kill (reaping the engine's processes) is not the proxy's cost.
    kill_s = killed_at - frozen_at
    print(
        f"unbroken {unbroken_s:.2f} s; migrated at token {cont['migrated_at_token']} of "
        f"{MAX_TOKENS}: {total_s:.2f} s in all, {kill_s:.2f} s of it the test's kill; time "
        f"added {total_s - kill_s - unbroken_s:+.2f} s; the first new token "
        f"{resumed_in if resumed_in is not None else float('nan'):.2f} s after the kill; "
        f"continuation {cont['status']}, prefill {cont['prefill_ms']} ms, {cont['total_ms']:.0f} ms"
    )
