"""The KV digest of each push (issue 51) over real sidecars, real Mooncake and simulated engines:
a bit flipped on the wire in every run prefill writes is caught at decode, every request of it
fails (its engine recomputes it) and none reads DONE; with the digest off the same flips reach
decode unchecked (the simulated engine's own byte check is the only one to see them)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import pytest

from app.sim.cluster import Cluster
from app.sim.rounds import summarize
from tests.conftest import counter_by, digested_bytes
from tests.e2e import fault_sidecar
from tests.e2e.conftest import request_entry

# One preset per group kind the check must cover: full attention, a sliding window (+ full),
# MLA (+ its indexer), a GDN state (+ full). Requests per preset: 100 in all.
MODELS = {  # preset -> layers (enough for each of its group kinds)
    "llama-3.1-8b": 2,
    "gpt-oss-20b": 4,
    "deepseek-v3.2-exp": 2,
    "qwen3-next-80b-a3b": 4,
}
TRIALS = 25
FAST = {"KVSIDECAR_ACK_TIMEOUT_S": "3", "KVSIDECAR_HANDSHAKE_TIMEOUT_S": "3"}


def _flipped_cluster(make_cluster: Callable[..., Cluster], model: str, share: str) -> Cluster:
    return make_cluster(
        model=model,
        layers=MODELS[model],
        prefill_tp=1,
        decode_tp=1,
        max_requests=TRIALS,
        max_prompt=160,
        sidecar_cmd={"prefill": fault_sidecar.command(flip_writes=True)},
        sidecar_env={**FAST, "KVSIDECAR_KV_DIGEST__SHARE": share},
    )


def _decode_errors(result: dict[str, Any]) -> dict[str, str]:
    return {rid: f["error"] for r in result["decode"]["ranks"] for rid, f in r["failed"].items()}


@pytest.mark.parametrize("model", sorted(MODELS))
def test_a_bit_flipped_on_the_wire_fails_every_request(
    make_cluster: Callable[..., Cluster], model: str
) -> None:
    c = _flipped_cluster(make_cluster, model, "1.0")
    pairs = c.make_requests([160 - 7 * i % 90 for i in range(TRIALS)])
    result = c.run(pairs, timeout_s=60)
    s = summarize(result, pairs)
    assert s["verified"] == 0
    errors = _decode_errors(result)
    assert sorted(errors) == sorted(pr.id for pr, _ in pairs)
    # One mismatch counted a request, however many of its layers' checks found one.
    counted = counter_by(c.sides["decode"].admin_url, "kvsidecar_kv_digest_mismatches", "side")
    assert counted.get("decode") == TRIALS, counted
    assert all("KV digest mismatch" in e and "block" in e for e in errors.values()), errors
    # The decode record on the admin API says where, with the request's own block ids.
    d = c.sides["decode"]
    for _, dr in pairs[:3]:
        entry = request_entry(d.admin_url, dr.id)
        assert (entry["state"], entry["digest"]) == ("FAILED", "mismatch"), entry
        where = entry["digest_mismatch"]
        blocks = {g["group"]: g["block_ids"] for g in entry["groups"]}
        assert where["block"] in blocks[where["group"]], (where, blocks)
        assert f"layer {where['layer']}, group {where['group']} ({where['kind']})" in entry["error"]
        # With more than two layer placements (DeepSeek's two layers hold an MLA latent and an
        # indexer each) the first is checked as it landed, before Done; Llama's two go in Done.
        assert (entry["digest_early_ms"] > 0) == (model != "llama-3.1-8b"), entry


def test_with_the_digest_off_nothing_is_checked(make_cluster: Callable[..., Cluster]) -> None:
    c = _flipped_cluster(make_cluster, "llama-3.1-8b", "0")
    pairs = c.make_requests([160, 100])
    s = summarize(c.run(pairs, timeout_s=60), pairs)
    # Decode declared them DONE: only the simulated engine's byte check sees the flips.
    assert {f["status"] for f in s["failures"].values()} == {"CORRUPT"}
    assert not any("digest" in f["error"] for f in s["failures"].values())


@pytest.mark.parametrize("share", ["0", "1.0"])
def test_with_the_digest_off_no_byte_is_digested(
    make_cluster: Callable[..., Cluster], share: str
) -> None:
    """Both sidecars count every byte they digest: with ``share`` 0 the count stays 0 on both
    sides of both sidecars over transfers that carried KV; with 1 it moved on both (so the
    counter is one the digest feeds)."""
    c = make_cluster(
        model="llama-3.1-8b",
        layers=2,
        prefill_tp=1,
        decode_tp=1,
        max_requests=4,
        max_prompt=160,
        sidecar_env={**FAST, "KVSIDECAR_KV_DIGEST__SHARE": share},
    )
    pairs = c.make_requests([160, 100, 64, 33])
    s = summarize(c.run(pairs, timeout_s=60), pairs)
    assert s["verified"] == 4, s
    p = digested_bytes(c.sides["prefill"].admin_url)
    d = digested_bytes(c.sides["decode"].admin_url)
    records = {
        (side, e["digest"], e["digest_mismatch"] is None, (e["digest_ms"] or 0) > 0)
        for side in ("prefill", "decode")
        for pr, dr in pairs
        for e in httpx.get(
            f"{c.sides[side].admin_url}/v1/requests/{(pr if side == 'prefill' else dr).id}",
            timeout=10,
        ).json()["entries"]
    }
    if share == "0":
        assert (p, d) == ({"prefill": 0, "decode": 0}, {"prefill": 0, "decode": 0})
        assert records == {("prefill", "off", True, False), ("decode", "off", True, False)}
    else:
        # Prefill digests what it wrote, decode the same bytes where they landed.
        assert p["prefill"] > 0 and p["prefill"] == d["decode"], (p, d)
        # Each record says how long the digest held the request up, on each side.
        assert records == {("prefill", "sent", True, True), ("decode", "ok", True, True)}


def test_the_default_share_checks_one_request_in_eight(
    make_cluster: Callable[..., Cluster],
) -> None:
    """At the default share, 24 requests draw 3 give or take 2 (the draw's bound itself is
    tests/kvcache/test_digest_draw.py's), all of each: decode checked exactly the requests
    prefill digested, and no other."""
    n = 24
    c = make_cluster(
        model="llama-3.1-8b",
        layers=2,
        prefill_tp=1,
        decode_tp=1,
        max_requests=n,
        max_prompt=96,
        sidecar_env=FAST,
    )
    pairs = c.make_requests([96 - i for i in range(n)])
    s = summarize(c.run(pairs, timeout_s=60), pairs)
    assert s["verified"] == n, s

    def states(side: str, ids: list[str]) -> list[str]:
        return [request_entry(c.sides[side].admin_url, rid)["digest"] for rid in ids]

    sent = states("prefill", [pr.id for pr, _ in pairs])
    checked = states("decode", [dr.id for _, dr in pairs])
    assert 1 <= sent.count("sent") <= 5, sent
    assert [x == "sent" for x in sent] == [x == "ok" for x in checked], (sent, checked)
    assert set(sent) <= {"sent", "off"} and set(checked) <= {"ok", "off"}
