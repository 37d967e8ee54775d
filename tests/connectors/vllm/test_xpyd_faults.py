"""An instance's vLLM dies while requests are on it, with another of its kind beside it (the
session's 2-prefill, 2-decode ``xpyd``, after test_xpyd.py; these kill and run last).

- A prefill killed with prompts on it: the proxy does not retry them (the prefill may have
  claimed decode's blocks), it tells decode's sidecar at once, and decode recomputes. Every
  client gets the one-engine answer, and no affected request waits for decode's 15 s deadline:
  each answers within the unloaded latency + 2 s of the engine's end.
- A decode killed before its first byte: the proxy retries each request on the other decode as a
  new transfer. No client sees an error, streamed or not, and every answer is the one-engine
  answer.

"Prompts on it" is made exact by freezing the instance (SIGSTOP on its process tree) before the
requests go out: the proxy's records then show which requests wait on it when it is killed.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import httpx
import pytest

from app.harness.local_pd import Instance, LocalPD
from app.harness.proc_tree import process_tree, signal_all
from tests.conftest import wait_for
from tests.connectors.vllm.conftest import prompt

pytestmark = pytest.mark.slow_engines

LENGTH = 600
MAX_TOKENS = 6
REQUESTS = 4
SLACK_S = 2.0  # the bound: unloaded + 2 s, not + the 15 s deadline


@contextmanager
def frozen(pd: LocalPD, *instances: Instance) -> Iterator[None]:
    """The vLLM of each of ``instances`` and every process it started, stopped until the block
    ends (or killed within it)."""
    pids = [p for i in instances for p in process_tree(pd.procs[f"vllm-{i.name}"].pid)]
    signal_all(pids, signal.SIGSTOP)
    try:
        yield
    finally:
        signal_all(pids, signal.SIGCONT)


def _cases(pd: LocalPD, salt: int, n: int) -> list[tuple[list[int], list[int]]]:
    """(prompt, expected answer) pairs: the prompt ends with the engine's own first token (so
    decode's one computed token is the same computation), the answer is the rest."""
    ref = pd.decode_instances[-1].url
    out = []
    for i in range(n):
        seed = prompt(LENGTH, salt + i)
        tokens = pd.complete(ref, seed, MAX_TOKENS + 1)
        out.append(([*seed, tokens[0]], tokens[1:]))
    return out


def _stream(proxy: str, tokens: list[int]) -> dict[str, Any]:
    """A streamed completion's token ids and any error event it carried."""
    body = {
        "model": "tiny",
        "prompt": tokens,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "return_token_ids": True,
        "stream": True,
    }
    got: list[int] = []
    errors = []
    with httpx.stream("POST", f"{proxy}/v1/completions", json=body, timeout=120) as r:
        status = r.status_code
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                errors.append(event["error"])
            else:
                got.extend(event["choices"][0].get("token_ids") or [])
    return {"status": status, "tokens": got, "errors": errors}


def _pending_on(proxy: str, field: str, url: str) -> Callable[[], list[dict[str, Any]] | None]:
    def check() -> list[dict[str, Any]] | None:
        held = [r for r in _records(proxy) if r["status"] == "pending" and r[field] == url]
        return held or None

    return check


def _unloaded_s(pd: LocalPD) -> float:
    ((tokens, _),) = _cases(pd, 900, 1)
    t0 = time.monotonic()
    pd.completion(pd.proxy, tokens, MAX_TOKENS)
    return time.monotonic() - t0


def test_prefill_killed_with_prompts_on_it(xpyd: LocalPD) -> None:
    victim = xpyd.prefill_instances[-1]
    cases = _cases(xpyd, 500, REQUESTS)
    unloaded = _unloaded_s(xpyd)
    ended: list[float] = []
    with ThreadPoolExecutor(REQUESTS) as pool, frozen(xpyd, victim):
        calls = [
            pool.submit(xpyd.completion, xpyd.proxy, tokens, MAX_TOKENS) for tokens, _ in cases
        ]
        for c in calls:
            c.add_done_callback(lambda _: ended.append(time.monotonic()))
        on_victim = _pending_on(xpyd.proxy, "prefill", victim.url)
        held = wait_for("a prompt on the frozen prefill", on_victim, 30)
        t0 = time.monotonic()
        xpyd.kill(f"vllm-{victim.name}")  # returns once every process of it is gone
        killed = time.monotonic()
        answers = [c.result(timeout=120) for c in calls]
    assert [a["choices"][0]["token_ids"] for a in answers] == [want for _, want in cases]
    records = {r["transfer_id"]: r for r in _records(xpyd.proxy)}
    affected = [records[h["transfer_id"]] for h in held]
    for r in affected:
        assert r["status"] == "prefill_failed" and r["decode_stop"], r
        assert r["kv_load"] == "failed", r  # decode recomputed, told at once
    slowest = max(ended) - killed
    print(
        f"unloaded {unloaded:.2f} s; the kill took {killed - t0:.2f} s; every answer within "
        f"{slowest:.2f} s of the engine's end ({len(affected)} on it)"
    )
    assert slowest <= unloaded + SLACK_S, (slowest, unloaded)


def test_decode_killed_before_its_first_byte(xpyd: LocalPD) -> None:
    victim = xpyd.decode_instances[0]
    # A prefill the test above killed: until the proxy's health check sees it gone, a request
    # can spend its one retry there and then find no budget when its decode dies (a 502, seen
    # once in a clean-clone run).
    dead = {
        p.url for p in xpyd.prefill_instances if xpyd.procs[f"vllm-{p.name}"].poll() is not None
    }
    wait_for(
        "the proxy to see the killed prefill",
        lambda: (
            not any(
                i["healthy"]
                for i in httpx.get(f"{xpyd.proxy}/health", timeout=5).json()["prefill"]
                if i["url"] in dead
            )
        ),
        30,
    )
    cases = _cases(xpyd, 700, REQUESTS + 2)
    prefills = [p for p in xpyd.prefill_instances if xpyd.procs[f"vllm-{p.name}"].poll() is None]
    with ThreadPoolExecutor(len(cases)) as pool:
        # Prefill frozen: decode waits for the KV and sends nothing yet.
        with frozen(xpyd, *prefills):
            calls: list[Future[Any]] = [
                pool.submit(xpyd.completion, xpyd.proxy, tokens, MAX_TOKENS)
                for tokens, _ in cases[:REQUESTS]
            ]
            calls += [pool.submit(_stream, xpyd.proxy, tokens) for tokens, _ in cases[REQUESTS:]]
            wait_for("a request on the decode", _pending_on(xpyd.proxy, "decode", victim.url), 30)
            xpyd.kill(f"vllm-{victim.name}")
        results = [c.result(timeout=120) for c in calls]
    plain, streams = results[:REQUESTS], results[REQUESTS:]
    assert [a["choices"][0]["token_ids"] for a in plain] == [w for _, w in cases[:REQUESTS]]
    for s, (_, want) in zip(streams, cases[REQUESTS:], strict=True):
        assert (s["status"], s["errors"], s["tokens"]) == (200, [], want), s
    retried = [r for r in _records(xpyd.proxy) if r.get("retried_as")]
    assert retried and all(r["decode"] == victim.url for r in retried), retried


def _records(proxy: str) -> list[dict[str, Any]]:
    records = httpx.get(f"{proxy}/v1/transfers", params={"limit": 50}, timeout=10).json()
    return list(records["transfers"])
