"""Real engines, real sidecars, the proxy: decode after a layer-wise push behaves as if it had
prefilled itself, and what it reads is byte-equal to what prefill computed. Both behaviours
share one engine pair per model (engine start dominates the cost).

Output equality (the engine's own output without a transfer is the reference) catches KV or
state written to the wrong blocks, layers, heads or groups; a transfer that silently did not
happen (decode would compute the whole prompt: vLLM's local_compute counter); a sliding window
sent from the wrong blocks (gemma3, prompts longer than its 64-token window); a lost partial
last block (lengths not a multiple of the block size); a GDN state that is not the one after
the prompt minus its last token (qwen3next). Byte equality catches the same at the byte level.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
import torch

from app.harness.engines import MAX_MODEL_LEN, prompt_tokens_by_source
from app.harness.local_pd import LocalPD
from tests.conftest import wait_for
from tests.connectors.vllm.conftest import (
    EngineKV,
    TargetCatcher,
    block_ids,
    group_counters,
    kv_usage,
    last_transfer,
    prompt,
    read_blocks,
    whole_block_lengths,
)
from tests.connectors.vllm.vllm_metrics import metrics, wait_counted

LENGTHS = (37, 130, 300, 600)
MAX_TOKENS = 8
HYBRIDS = ["qwen3next+f32", "qwen3next+bf16"]  # GDN state in float32 and in bf16 (any CPU)


def engine_groups(pd: LocalPD) -> list[dict[str, Any]]:
    """Decode's KV cache groups as its engine registered them (kind, block sizes, window)."""
    reg = httpx.get(f"{pd.decode.admin}/v1/registration", timeout=10).json()["ranks"]["0"]
    return list(reg["groups"])


def boundary_lengths(pd: LocalPD) -> list[int]:
    """Prompt lengths k*B - 1, k*B, k*B + 1, k*B + 2 for every block size B the engine chose
    (manager and kernel blocks of every group, a state group's too) that fit the model length.
    A prompt of N tokens leaves N - 1 to the transfer, so N = k*B + 1 is where a planner that
    plans the whole prompt needs one more decode block than decode allocated."""
    sizes = {int(g[key]) for g in engine_groups(pd) for key in ("block_size", "kernel_block_size")}
    limit = MAX_MODEL_LEN - MAX_TOKENS - 2
    lengths = {
        k * b + d for b in sizes for k in (1, 2) for d in (-1, 0, 1, 2) if 2 <= k * b + d <= limit
    }
    return sorted(lengths)


def byte_lengths(pd: LocalPD) -> list[int]:
    return whole_block_lengths(engine_groups(pd), MAX_MODEL_LEN - MAX_TOKENS - 2)


def references(pd: LocalPD, seeds: list[list[int]]) -> tuple[list[list[int]], list[list[int]]]:
    """Prompts and the prefill engine's own answers on decode's compute path, no transfer."""
    pairs = [pd.reference(seed, MAX_TOKENS) for seed in seeds]
    return [p for p, _ in pairs], [a for _, a in pairs]


def through_proxy(pd: LocalPD, prompts: list[list[int]]) -> list[list[int]]:
    """The same prompts through the proxy (decode first), concurrently where the engine's
    output does not depend on its batch: vLLM's CPU MLA answers the same prompts differently
    batched than alone, from the first token (measured: 4 of 4 differ), and its GDN with bf16
    state drifts late in some answers when a dozen prompts prefill together (1 of 12, from
    the 8th token), so those go one by one. So does Gemma 3: with the KV arriving layer by
    layer, decode's batches differ from before, and its 257-token boundary prompt, batched,
    differs at the 8th token from its answer alone: through the proxy in 5 of 6 runs (its KV
    bytes equal prefill's), and sent batched to decode's engine alone, no transfer at all."""
    if pd.kind in ("deepseek", "qwen3next", "gemma3"):
        return [pd.complete(pd.proxy, p, MAX_TOKENS) for p in prompts]
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p: pd.complete(pd.proxy, p, MAX_TOKENS), prompts))


def assert_transferred(pd: LocalPD, prompts: list[list[int]], reference: list[list[int]]) -> None:
    """Through the proxy: outputs equal the reference, decode computed exactly each prompt's
    last token and loaded the rest, and every group of every request completed."""
    before = prompt_tokens_by_source(pd.decode.url)
    d_before = group_counters(pd.decode.admin)
    p_before = group_counters(pd.prefill.admin)

    assert through_proxy(pd, prompts) == reference
    after = prompt_tokens_by_source(pd.decode.url)
    # Decode computed exactly the one token per prompt the protocol leaves to it.
    assert after.get("local_compute", 0) - before.get("local_compute", 0) == len(prompts)
    assert after.get("external_kv_transfer", 0) - before.get("external_kv_transfer", 0) == sum(
        len(p) - 1 for p in prompts
    )
    # Every group of every request completed at decode, and prefill wrote bytes for each.
    for b, a in zip(d_before, group_counters(pd.decode.admin), strict=True):
        assert a["done"] - b["done"] == len(prompts), a
    for b, a in zip(p_before, group_counters(pd.prefill.admin), strict=True):
        assert a["bytes"] > b["bytes"], a


@pytest.mark.parametrize(
    "pd", ["llama", "gemma3", "deepseek", *HYBRIDS, "llama+inproc"], indirect=True
)
def test_decode_equals_reference(pd: LocalPD) -> None:
    """Greedy outputs through P/D equal one engine's alone ("llama+inproc": the vLLM workers
    host their agents in-process)."""
    prompts, reference = references(pd, [prompt(n - 1, i) for i, n in enumerate(LENGTHS)])
    assert len({tuple(r) for r in reference}) == len(prompts), "tiny model is not distinctive"
    assert_transferred(pd, prompts, reference)


@pytest.mark.parametrize("pd", ["llama", "gemma3", "deepseek", *HYBRIDS], indirect=True)
def test_every_length_transfers(pd: LocalPD) -> None:
    """Prompts just around every block boundary the engine chose transfer, and decode computes
    only their last token (a 129-token prompt at block size 128 used to fail both sides and
    be recomputed whole, with the right output: only the counters showed it)."""
    lengths = boundary_lengths(pd)
    prompts, reference = references(pd, [prompt(n - 1, 20 + i) for i, n in enumerate(lengths)])
    assert [len(p) for p in prompts] == lengths
    assert_transferred(pd, prompts, reference)


@pytest.mark.parametrize("pd", ["llama", "gemma3", "deepseek", *HYBRIDS], indirect=True)
def test_decode_blocks_equal_prefill_blocks(pd: LocalPD) -> None:
    """Requests go one at a time: a finished send frees its prefill blocks and a later request
    may reuse them, so both caches are read right after each request. State pages are left to
    the output test: decode's own step has already advanced them when they can be read."""
    p_kv = EngineKV(pd.prefill.admin, pd.procs["sidecar-prefill"].pid)
    d_kv = EngineKV(pd.decode.admin, pd.procs["sidecar-decode"].pid)
    checked = 0
    for i, n in enumerate(byte_lengths(pd)):
        answer = pd.completion(pd.proxy, prompt(n, 50 + i), 2)
        rid = answer["kv_transfer_params"]["kv_sidecar_request_id"]
        p_ids = block_ids(pd.prefill.admin, rid, "send")
        d_ids = block_ids(pd.decode.admin, rid, "recv")
        for name, layer in d_kv.layers.items():
            g = layer["group"]
            if d_kv.groups[g]["kind"] == "mamba":
                continue
            blocks = read_blocks(d_kv.groups[g], d_kv.kernel_block_size(name), n)
            want = p_kv.pages(name, p_ids[g], blocks) if blocks else None
            got = d_kv.pages(name, d_ids[g], blocks) if blocks else None
            if want is None or got is None:
                continue
            assert want.any(), f"{name}: prefill pages are empty"
            bad = [j for k, j in enumerate(blocks) if not torch.equal(want[k], got[k])]
            assert not bad, (
                f"{rid} {name}: kernel blocks {bad[:5]} of {blocks} differ; prefill blocks "
                f"{p_ids[g]}, decode blocks {d_ids[g]}"
            )
            checked += len(blocks)
    assert checked > 0


@pytest.mark.parametrize("pd", ["llama"], indirect=True)
def test_captured_target_with_another_prompt_writes_nothing(
    pd: LocalPD, router: TargetCatcher
) -> None:
    """A stranger who saw decode's signed target for prompt X (on the proxy -> prefill leg)
    posts it to prefill with the transfer id it names and another prompt Y of the same length
    (issue 50, item 9). Before, Y's KV landed in X's blocks and decode answered otherwise than
    X's reference. Now prefill's sidecar refuses the target (signed for X's prompt), counts it
    and connects nowhere: the send writes 0 bytes. The genuine prefill of X, sent after, still
    goes through, and decode answers X's reference from prefill's KV."""
    x, y = prompt(300, 7), prompt(300, 8)
    reference = pd.complete(pd.prefill.url, x, MAX_TOKENS)
    body = {"model": "tiny", "max_tokens": MAX_TOKENS, "temperature": 0, "return_token_ids": True}
    metrics_url = f"{pd.prefill.admin}/metrics"
    before = refused_targets(metrics_url)
    with ThreadPoolExecutor(1) as pool:
        decode = pool.submit(
            httpx.post,
            f"{pd.decode.url}/v1/completions",
            json={
                **body,
                "prompt": x,
                "kv_transfer_params": {
                    "do_remote_prefill": True,
                    "transfer_id": "captured",
                    "router_url": router.url,
                },
            },
            timeout=180,
        )
        target = router.wait("captured", 60)
        tid = str(target["request_id"])
        captured = {"do_remote_decode": True, "transfer_id": tid, "remote": target}

        def prefill_of(p: list[int]) -> None:
            r = httpx.post(
                f"{pd.prefill.url}/v1/completions",
                json={**body, "prompt": p, "max_tokens": 1, "kv_transfer_params": captured},
                timeout=120,
            )
            assert r.status_code == 200, r.text

        prefill_of(y)
        stranger = wait_for(
            "the stranger's send reported", lambda: (e := send_entry(pd, tid))["reported"] and e
        )
        assert stranger["state"] == "FAILED", stranger
        assert "signed for another prompt" in (stranger["error"] or ""), stranger
        assert stranger["bytes"] == 0 and not stranger["targets"], stranger
        assert refused_targets(metrics_url) == before + 1
        prefill_of(x)  # the proxy's own prefill of X
        answer = decode.result().json()
    assert answer["choices"][0]["token_ids"] == reference
    assert answer["kv_transfer_params"]["kv_load"] == "ok"  # prefill's KV, not recomputed


def refused_targets(url: str) -> float:
    text = httpx.get(url, timeout=10).text
    (line,) = [ln for ln in text.splitlines() if ln.startswith("kvsidecar_refused_targets_total ")]
    return float(line.split()[1])


def num_layers(admin: str) -> int:
    groups = httpx.get(f"{admin}/v1/groups", timeout=10).json()["groups"]
    return sum(len(g["layers"]) for g in groups)


def send_entry(pd: LocalPD, tid: str) -> dict[str, Any]:
    (entry,) = httpx.get(f"{pd.prefill.admin}/v1/requests/{tid}", timeout=10).json()["entries"]
    return dict(entry)


def prefill_alone(
    pd: LocalPD, p: list[int], tid: str, router: TargetCatcher, wait_s: float
) -> None:
    """Prefill of ``p`` as the concurrent flow sends it: no target, fetched from ``router``."""
    answer = pd.completion(
        pd.prefill.url,
        p,
        1,
        kv_transfer_params={
            "do_remote_decode": True,
            "transfer_id": tid,
            "router_url": router.url,
            "target_timeout_s": wait_s,
        },
    )
    assert answer["choices"][0]["token_ids"], answer


def decode_from(pd: LocalPD, p: list[int], tid: str, router: TargetCatcher) -> list[int]:
    params = {"do_remote_prefill": True, "transfer_id": tid, "router_url": router.url}
    answer = pd.completion(pd.decode.url, p, MAX_TOKENS, kv_transfer_params=params)
    return list(answer["choices"][0]["token_ids"])


@pytest.mark.parametrize("pd", ["llama"], indirect=True)
def test_target_after_prefill_finished(pd: LocalPD, router: TargetCatcher) -> None:
    """Concurrent dispatch, decode late: prefill computed the whole prompt and answered before
    decode allocated anything. Its sidecar kept every layer; once decode's target arrives it
    writes them all (the backlog), and decode answers as if it had prefilled itself."""
    (p,), (reference,) = references(pd, [prompt(300, 61)])
    before = prompt_tokens_by_source(pd.decode.url)
    prefill_alone(pd, p, "late-target", router, 60)
    held = send_entry(pd, "late-target")
    assert held["state"] == "PENDING" and held["bytes"] == 0 and held["peer"] is None, held
    # One step, every layer signalled: all kept for the target.
    assert held["held_layers"] == num_layers(pd.prefill.admin), held
    assert decode_from(pd, p, "late-target", router) == reference
    after = prompt_tokens_by_source(pd.decode.url)
    assert after.get("local_compute", 0) - before.get("local_compute", 0) == 1
    sent = send_entry(pd, "late-target")
    assert sent["state"] == "DONE" and sent["bytes"] > 0, sent


@pytest.mark.parametrize("pd", ["llama"], indirect=True)
def test_target_that_never_comes(pd: LocalPD, router: TargetCatcher) -> None:
    """Decode's target is lost on the way: prefill's wait for it ends, its send ends and its
    blocks go back to vLLM; decode's sidecar expires the load and decode recomputes."""
    (p,), (reference,) = references(pd, [prompt(300, 62)])
    router.drop.add("lost-target")
    before = prompt_tokens_by_source(pd.decode.url)
    with ThreadPoolExecutor(1) as pool:
        decode = pool.submit(decode_from, pd, p, "lost-target", router)
        prefill_alone(pd, p, "lost-target", router, 2.0)
        assert router.fetched("lost-target", 30) == 504
        assert decode.result(timeout=120) == reference
    after = prompt_tokens_by_source(pd.decode.url)
    assert after.get("local_compute", 0) - before.get("local_compute", 0) == len(p)
    ended = send_entry(pd, "lost-target")
    assert ended["state"] == "ABORTED" and ended["reported"] and ended["bytes"] == 0, ended
    assert "no target from decode" in ended["error"], ended
    assert kv_usage(pd.prefill.url) == 0.0  # prefill's blocks went back to vLLM


@pytest.mark.parametrize("pd", ["llama"], indirect=True)
def test_repeated_prompt_sends_only_what_decode_lacks(pd: LocalPD) -> None:
    """With prefix caching, decode holds the whole blocks of a prompt it served before: the
    second time prefill writes only the blocks after them, and the answer is the same."""
    (p,), (reference,) = references(pd, [prompt(300, 63)])
    block = int(engine_groups(pd)[0]["block_size"])
    cached = (len(p) - 1) // block * block  # whole blocks of the tokens decode loaded
    assert 0 < cached < len(p) - 1
    sent = []
    for _ in range(2):
        answer = pd.completion(pd.proxy, p, MAX_TOKENS)
        assert answer["choices"][0]["token_ids"] == reference
        sent.append(send_entry(pd, answer["kv_transfer_params"]["kv_sidecar_request_id"]))
    first, second = sent
    assert first["state"] == second["state"] == "DONE"
    kernel = int(engine_groups(pd)[0]["kernel_block_size"])
    whole = -(-(len(p) - 1) // kernel)  # kernel blocks the first transfer wrote
    # The second writes only those after decode's cached blocks.
    assert second["bytes"] * whole == first["bytes"] * (whole - cached // kernel), sent


@pytest.mark.parametrize("pd", ["llama"], indirect=True)
def test_metrics_match_the_sidecars(pd: LocalPD) -> None:
    """One request through the proxy: prefill's /metrics counts one send, decode's one recv,
    each with the bytes and the time its sidecar's /v1/requests reports for that request."""
    p_before, d_before = metrics(pd.prefill.url), metrics(pd.decode.url)
    answer = pd.completion(pd.proxy, prompt(300, 3), 2)
    rid = answer["kv_transfer_params"]["kv_sidecar_request_id"]
    p = wait_counted(pd.prefill.url, p_before, "transfers/send")
    d = wait_counted(pd.decode.url, d_before, "transfers/recv")

    for base, got, side in ((pd.prefill.admin, p, "send"), (pd.decode.admin, d, "recv")):
        entries = httpx.get(f"{base}/v1/requests/{rid}", timeout=10).json()["entries"]
        mine = [e for e in entries if e["side"] == side]
        assert mine and all(e["state"] == "DONE" for e in mine), entries
        other = "recv" if side == "send" else "send"
        assert got[f"transfers/{side}"] == 1, got
        assert got[f"time_count/{side}"] == 1, got
        assert got[f"bytes/{side}"] == sum(e["bytes"] for e in mine) > 0, (got, mine)
        # The admin rounds to 0.1 ms; the metric is the slowest rank's.
        assert got[f"time_sum/{side}"] == pytest.approx(
            max(e["duration_s"] for e in mine), abs=2e-4
        ), (got, mine)
        assert got[f"failed/{side}"] == got[f"expired/{side}"] == 0, got
        assert got[f"transfers/{other}"] == got[f"bytes/{other}"] == 0, got
    # Both ends of the push agree on what moved.
    assert p["bytes/send"] == d["bytes/recv"]


# What vLLM's example toy_proxy_server.py sends prefill: every field of the standard flow,
# nothing of kv-sidecar's own.
STANDARD_PREFILL_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def prefill_first(pd: LocalPD, p: list[int]) -> dict[str, Any]:
    """vLLM's standard flow, step one: prefill alone; its answer's ``kv_transfer_params``."""
    answer = pd.completion(pd.prefill.url, p, 1, kv_transfer_params=STANDARD_PREFILL_PARAMS)
    params = answer.get("kv_transfer_params")
    assert isinstance(params, dict) and params.get("do_remote_prefill"), answer
    return params


@pytest.mark.parametrize("pd", ["llama"], indirect=True)
def test_prefill_first_through_a_plain_client(pd: LocalPD) -> None:
    """A client that speaks only vLLM's documented flow (no kv-sidecar proxy): the prompt to
    prefill, then to decode with the ``kv_transfer_params`` prefill answered. Prefill kept its
    blocks; decode posts its target (signed by its sidecar, with no admin token) to prefill's
    sidecar, which runs with a control-plane key and an admin token set and writes every
    layer; decode computes one token and answers as the engine alone does."""
    prompts, reference = references(pd, [prompt(37, 71), prompt(600, 72)])
    for p, expected in zip(prompts, reference, strict=True):
        params = prefill_first(pd, p)
        held = send_entry(pd, params["transfer_id"])
        assert held["state"] == "PENDING" and held["bytes"] == 0, held
        before = prompt_tokens_by_source(pd.decode.url)
        answer = pd.completion(pd.decode.url, p, MAX_TOKENS, kv_transfer_params=params)
        assert answer["choices"][0]["token_ids"] == expected
        after = prompt_tokens_by_source(pd.decode.url)
        assert after.get("local_compute", 0) - before.get("local_compute", 0) == 1
        sent = send_entry(pd, params["transfer_id"])
        assert sent["state"] == "DONE" and sent["bytes"] > 0, sent
    wait_for("prefill's blocks back in vLLM", lambda: kv_usage(pd.prefill.url) == 0.0, 10)


@pytest.mark.parametrize("pd", ["llama"], indirect=True)
def test_prefill_first_decode_refusal_frees_prefill(pd: LocalPD) -> None:
    """Decode posts why it cannot take the transfer instead of a target: prefill's sidecar
    ends the send ABORTED at once and its blocks go back to vLLM, long before the deadline.
    An error ends a transfer, so with the admin token set it needs the token."""
    params = prefill_first(pd, prompt(300, 73))
    assert kv_usage(pd.prefill.url) > 0.0  # held for decode
    refusal = {"transfer_id": params["transfer_id"], "error": "decode is shutting down"}
    stranger = httpx.post(params["router_url"], json=refusal, timeout=10)
    assert stranger.status_code == 401, stranger.text
    assert send_entry(pd, params["transfer_id"])["state"] == "PENDING"
    t0 = time.monotonic()
    token = {"Authorization": f"Bearer {pd.admin_token}"}
    r = httpx.post(params["router_url"], json=refusal, headers=token, timeout=10)
    assert r.status_code == 200, r.text
    wait_for("prefill's blocks back in vLLM", lambda: kv_usage(pd.prefill.url) == 0.0, 5)
    assert time.monotonic() - t0 < pd.target_timeout_s
    ended = send_entry(pd, params["transfer_id"])
    assert ended["state"] == "ABORTED" and "decode is shutting down" in ended["error"], ended
    again = httpx.post(params["router_url"], json=refusal, headers=token, timeout=10)
    assert again.status_code == 409, again.text


@pytest.mark.parametrize("pd", ["llama"], indirect=True)
def test_repeated_long_prompt_served_by_decode_alone(pd: LocalPD) -> None:
    """Conditional disaggregation on real engines (a second proxy with the default rules): a
    long prompt goes through prefill once; sent again, decode holds it (its prefix cache) and
    serves it alone: prefill computes nothing, decode's cache hits, the answer is the same."""
    url = pd.start_proxy("proxy-disagg", pd.prefill, pd.decode, "--decode-hit-fraction", "0.8")
    (p,), (reference,) = references(pd, [prompt(300, 74)])
    records = []
    for _ in range(2):
        before = prompt_tokens_by_source(pd.prefill.url), prompt_tokens_by_source(pd.decode.url)
        assert pd.complete(url, p, MAX_TOKENS) == reference
        after = prompt_tokens_by_source(pd.prefill.url), prompt_tokens_by_source(pd.decode.url)
        records.append((last_transfer(url), before, after))
    (first, *_), (second, (p_before, d_before), (p_after, d_after)) = records
    assert first["disaggregated"] and first["status"] == "ok", first
    assert not second["disaggregated"] and second["status"] == "local", second
    assert second["prefill"] is None and "decode holds" in second["reason"], second
    assert p_after == p_before  # prefill was not asked
    hit = d_after.get("local_cache_hit", 0) - d_before.get("local_cache_hit", 0)
    block = int(engine_groups(pd)[0]["block_size"])
    assert hit == (len(p) - 1) // block * block, (d_before, d_after)


@pytest.mark.parametrize("pd", ["llama", "gemma3"], indirect=True)
def test_prefill_sidecar_killed(pd: LocalPD) -> None:
    """Prefill's sidecar dies before the prefill runs: prefill's connector sees its engine link
    close and says in its answer that it sent nothing (``kv_send: failed``), the proxy tells
    decode's sidecar to stop waiting, and decode recomputes the prompt at once (not at its
    15 s deadline) with the right answer. Gemma-3 has two KV cache groups, where vLLM stops
    the engine on a block-level failure report. Brings a new sidecar up before it ends (the
    engine registers with it by itself), as the pair is shared."""
    p = prompt(200, 99)
    reference = pd.complete(pd.prefill.url, p, MAX_TOKENS)
    before = prompt_tokens_by_source(pd.decode.url)
    pd.kill("sidecar-prefill")
    t0 = time.monotonic()
    try:
        answer = pd.completion(pd.proxy, p, MAX_TOKENS, timeout_s=120)
    finally:
        pd.restart_sidecar(pd.prefill)
    elapsed = time.monotonic() - t0
    assert answer["choices"][0]["token_ids"] == reference
    after = prompt_tokens_by_source(pd.decode.url)
    # Decode computed the whole prompt itself: the failed load was recomputed, not used.
    assert after.get("local_compute", 0) - before.get("local_compute", 0) == len(p)
    # Without the answer's kv_send the proxy would not know, and decode would wait it out.
    assert elapsed < pd.recv_timeout_s / 2, elapsed
    record = last_transfer(pd.proxy)
    assert record["status"] == "send_failed" and "sent no KV" in record["error"], record
    assert record["decode_stop"] and "answered 200" in record["decode_stop"], record
    rid = answer["kv_transfer_params"]["kv_sidecar_request_id"]
    (entry,) = httpx.get(f"{pd.decode.admin}/v1/requests/{rid}", timeout=10).json()["entries"]
    assert entry["state"] == "ABORTED" and entry["reported"], entry
