"""Each layer of a digested push is checked while the engine computes the next ones (issue 51):
prefill digests a layer once the next one is written and sends it (``LayerDigests``, a few
layers a message), decode checks it as it landed, and ``Done`` carries only the last two
layers. Over real sidecars and Mooncake, a simulated engine that takes 25 ms a layer, every
request digested: both sides check 14 of 16 layers before ``Done``, in four messages, and what
each side's digest holds the request up after the last layer is a small part of what decode's
early checks took. With every layer checked after ``Done`` (the behaviour this test guards
against) decode's wait is the larger."""

from __future__ import annotations

from collections.abc import Callable

from app.sim.cluster import Cluster
from app.sim.rounds import summarize
from tests.conftest import digested_bytes
from tests.e2e import fault_sidecar
from tests.e2e.conftest import request_entry

LAYERS = 16
PROMPT = 1024  # 4 MiB of KV a layer (Llama-3.1-8B's heads): a digest of a few ms a layer


def test_layers_are_checked_as_they_land(make_cluster: Callable[..., Cluster]) -> None:
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

    for pr, dr in pairs:
        sent = request_entry(c.sides["prefill"].admin_url, pr.id)
        checked = request_entry(c.sides["decode"].admin_url, dr.id)
        assert (sent["digest"], checked["digest"]) == ("sent", "ok")
        # Every layer but the last two, on both sides' records, in four messages (4, 4, 4, 2
        # layers), not one a layer.
        assert sent["digest_early_layers"] == checked["digest_early_layers"] == LAYERS - 2
        assert checked["digest_early_checks"] == 4, checked
        early = float(checked["digest_early_ms"])
        p_ms, d_ms = float(sent["digest_ms"]), float(checked["digest_ms"])
        # After the last layer each side digests two layers; decode checked 14 before.
        assert p_ms < 0.5 * early and d_ms < 0.5 * early, (p_ms, d_ms, early)


def test_an_older_decode_gets_every_digest_in_done(make_cluster: Callable[..., Cluster]) -> None:
    """A decode that answers ``LayerDigests`` with ``Error`` (a release before them) still
    checks every byte: prefill sends it every layer's digests in ``Done``."""
    c = make_cluster(
        model="llama-3.1-8b",
        layers=4,
        prefill_tp=1,
        decode_tp=1,
        max_requests=3,
        max_prompt=PROMPT,
        sidecar_env={"KVSIDECAR_KV_DIGEST__SHARE": "1"},
        sidecar_cmd={"decode": fault_sidecar.command(old_decode=True)},
    )
    pairs = c.make_requests([PROMPT, PROMPT - 100, 300])
    s = summarize(c.run(pairs, compute_ms=25, timeout_s=60), pairs)
    assert s["verified"] == 3, s
    p = digested_bytes(c.sides["prefill"].admin_url)
    d = digested_bytes(c.sides["decode"].admin_url)
    assert p["prefill"] > 0 and p["prefill"] == d["decode"], (p, d)
    for pr, dr in pairs:
        for side, rid, state in (("prefill", pr.id, "sent"), ("decode", dr.id, "ok")):
            entry = request_entry(c.sides[side].admin_url, rid)
            assert (entry["digest"], entry["digest_early_layers"]) == (state, 0), entry
