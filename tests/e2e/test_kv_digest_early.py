"""Prefill digests a request's layers while the engine computes the next ones (issue 51): its
``Done`` waits for the last two layers' digests only (each layer is digested once the next one
is written). Over real sidecars and Mooncake, a simulated engine that takes 25 ms a layer,
every request digested: prefill's wait before ``Done`` is a small part of decode's check, which
digests all 16 layers after ``Done``. With every layer digested at ``Done`` (the behaviour this
test guards) the two are about equal."""

from __future__ import annotations

from collections.abc import Callable

import httpx

from app.sim.cluster import Cluster
from app.sim.rounds import summarize

LAYERS = 16
PROMPT = 1024  # 4 MiB of KV a layer (Llama-3.1-8B's heads): a digest of a few ms a layer


def test_done_waits_for_the_last_layer_only(make_cluster: Callable[..., Cluster]) -> None:
    c = make_cluster(
        model="llama-3.1-8b",
        layers=LAYERS,
        prefill_tp=1,
        decode_tp=1,
        max_requests=2,
        max_prompt=PROMPT,
        sidecar_env={"KVSIDECAR_KV_DIGEST__SHARE": "1"},
    )
    pairs = c.make_requests([PROMPT, PROMPT - 100])
    s = summarize(c.run(pairs, compute_ms=25, timeout_s=60), pairs)
    assert s["verified"] == 2, s

    def record(side: str, rid: str) -> dict[str, object]:
        url = c.sides[side].admin_url
        (entry,) = httpx.get(f"{url}/v1/requests/{rid}", timeout=10).json()["entries"]
        return entry

    for pr, dr in pairs:
        sent, checked = record("prefill", pr.id), record("decode", dr.id)
        assert (sent["digest"], checked["digest"]) == ("sent", "ok")
        p_ms, d_ms = float(sent["digest_ms"]), float(checked["digest_ms"])
        # Decode digests 16 layers after Done; prefill, at Done, two.
        assert p_ms < 0.5 * d_ms, (p_ms, d_ms)
