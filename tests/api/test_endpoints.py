"""Every admin endpoint over real HTTP against a live P/D pair, with requests in flight."""

from __future__ import annotations

import platform
import re
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from importlib import metadata
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from app.sim.cluster import Cluster
from app.transfer.wire.protocol import PROTOCOL_VERSION
from tests.api.conftest import AUTH, Batch, statuses, wait_for

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def samples(text: str) -> Samples:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def value(s: Samples, name: str, **labels: str) -> float:
    return s[(name, frozenset(labels.items()))]


@dataclass
class Run:
    """What the API said while a batch was in flight and after it ended."""

    batch: Batch
    p_list: dict[str, Any]
    d_list: dict[str, Any]
    p_transferring: dict[str, Any]
    d_pending: dict[str, Any]
    p_one_live: dict[str, Any]
    p_metrics_live: Samples
    abort_without_token: httpx.Response
    abort_wrong_token: httpx.Response
    abort_ok: httpx.Response
    abort_again: httpx.Response
    d_aborted: dict[str, Any]
    result: dict[str, Any]
    p_groups: dict[str, Any]
    p_status: dict[str, Any]
    p_one_done: httpx.Response
    abort_done: httpx.Response


@pytest.fixture(scope="module")
def run(
    make_batch: Callable[[str, int], Batch], prefill: httpx.Client, decode: httpx.Client
) -> Run:
    batch = make_batch("api", 3)
    # 8 chunks x 4 layers x 120 ms: about 4 s of prefill to read the API in.
    batch.start(compute_ms=120)
    ids = set(batch.ids)

    def moving() -> dict[str, Any] | None:
        body: dict[str, Any] = prefill.get("/v1/requests").json()
        reqs = [r for r in body["requests"] if r["id"] in ids]
        if len(reqs) == len(ids) and all(
            r["state"] == "TRANSFERRING" and r["bytes"] > 0 for r in reqs
        ):
            return body
        return None

    p_list = wait_for("every prefill request to be transferring", moving)
    d_list = decode.get("/v1/requests").json()
    p_transferring = prefill.get("/v1/requests", params={"state": "transferring"}).json()
    d_pending = decode.get("/v1/requests", params={"state": "Pending"}).json()
    p_one_live = prefill.get("/v1/requests/api-0").json()
    p_metrics_live = samples(prefill.get("/metrics").text)

    url = "/v1/requests/api-2/abort"
    abort_without_token = prefill.post(url)
    abort_wrong_token = prefill.post(url, headers={"Authorization": "Bearer nope"})
    abort_ok = prefill.post(url, headers=AUTH, json={"reason": "test abort"})
    abort_again = prefill.post(url, headers=AUTH)
    # Prefill tells decode: its copy ends ABORTED too.
    d_aborted = wait_for(
        "decode to see the abort",
        lambda: (
            r
            if (r := decode.get("/v1/requests/api-2").json())["entries"][0]["state"] == "ABORTED"
            else None
        ),
        timeout_s=10,
    )
    result = batch.finish()
    return Run(
        batch=batch,
        p_list=p_list,
        d_list=d_list,
        p_transferring=p_transferring,
        d_pending=d_pending,
        p_one_live=p_one_live,
        p_metrics_live=p_metrics_live,
        abort_without_token=abort_without_token,
        abort_wrong_token=abort_wrong_token,
        abort_ok=abort_ok,
        abort_again=abort_again,
        d_aborted=d_aborted,
        result=result,
        p_groups=prefill.get("/v1/groups").json(),
        p_status=prefill.get("/v1/status").json(),
        p_one_done=prefill.get("/v1/requests/api-0"),
        abort_done=prefill.post("/v1/requests/api-0/abort", headers=AUTH),
    )


def test_health(prefill: httpx.Client, decode: httpx.Client) -> None:
    for client in (prefill, decode):
        r = client.get("/livez")
        assert (r.status_code, r.json()) == (200, {"status": "ok"})
        r = client.get("/readyz")
        assert (r.status_code, r.json()) == (200, {"ready": True, "reason": "ready"})


def test_status(cluster: Cluster, prefill: httpx.Client, decode: httpx.Client) -> None:
    for role, client in (("prefill", prefill), ("decode", decode)):
        side = cluster.sides[role]
        s = client.get("/v1/status").json()
        assert s["role"] == role
        assert s["engine_id"] == side.engine_id
        assert s["epoch"] == side.info[0]["epoch"]
        assert s["ready"] is True and s["admitting"] is True
        assert s["control_endpoint"] == f"tcp://127.0.0.1:{side.control_port}"
        assert [r["rank"] for r in s["ranks"]] == [0]
        rank = s["ranks"][0]
        assert rank["registered"] is True and rank["engine_id"] == side.engine_id
        assert rank["num_blocks"] == side.params.num_blocks and rank["kv_layout"] == "engine"
        assert rank["stream_queue_capacity"] == 64
        assert re.fullmatch(r"127\.0\.0\.1:\d+", s["mooncake"]["session"])
        assert s["mooncake"]["transport"] == "tcp"
        assert s["uptime_s"] > 0
        started = datetime.fromisoformat(s["started_at"])
        assert started.tzinfo is not None and started < datetime.now(UTC)
        v = s["versions"]
        assert v["kv_sidecar"] == metadata.version("kv-sidecar")
        assert v["torch"] == metadata.version("torch")
        assert v["python"] == platform.python_version()
        assert v["protocol"] == PROTOCOL_VERSION
        assert v["mooncake"]


def test_regions(prefill: httpx.Client, decode: httpx.Client) -> None:
    for client in (prefill, decode):
        body = client.get("/v1/regions").json()
        assert [r["rank"] for r in body["ranks"]] == [0]
        rank = body["ranks"][0]
        assert rank["tp_size"] == 1 and rank["num_blocks"] > 0
        groups = {g["index"] for g in client.get("/v1/groups").json()["groups"]}
        layers: set[int] = set()
        for region in rank["regions"]:
            assert re.fullmatch(r"0x[0-9a-f]+", region["base"]) and int(region["base"], 16) > 0
            assert region["length"] > 0 and 0 < region["block_stride"] <= region["length"]
            assert region["group"] in groups
            assert all(
                s["offset"] + s["length"] <= region["block_stride"] for s in region["streams"]
            )
            layers |= set(region["layers"])
        # Qwen3-Next's pattern at 4 layers: three Gated-DeltaNet layers, one full attention.
        assert {r["kind"] for r in rank["regions"]} == {"STATE", "SPLIT"}
        assert layers == {0, 1, 2, 3}


def test_groups_count_what_moved(run: Run, decode: httpx.Client) -> None:
    groups = run.p_groups["groups"]
    assert [g["index"] for g in groups] == [0, 1, 2, 3]
    assert sorted(g["spec"] for g in groups) == ["full_attention", "mamba", "mamba", "mamba"]
    for g in groups:
        assert g["ranks"] == [0] and g["layers"]
        assert g["bytes"] > 0 and g["descriptors"] > 0 and g["layers_sent"] > 0
        assert g["transfers_ok"] > 0 and g["transfers_failed"] == 0
        assert g["block_size"] % g["kernel_block_size"] == 0
    # The groups' bytes are what Mooncake confirmed written, and what the engine was told.
    total = sum(g["bytes"] for g in groups)
    assert total == run.p_status["mooncake"]["bytes"]
    assert total == run.result["prefill"]["ranks"][0]["bytes"]
    # Decode receives: nothing is sent from there.
    assert all(g["bytes"] == 0 for g in decode.get("/v1/groups").json()["groups"])


def test_requests_in_flight(run: Run, cluster: Cluster) -> None:
    d = cluster.sides["decode"]
    sends = {r["id"]: r for r in run.p_list["requests"]}
    assert run.p_list["count"] == len(run.p_list["requests"])
    assert set(run.batch.ids) <= set(sends)
    for rid in run.batch.ids:
        r = sends[rid]
        assert (r["rank"], r["side"], r["state"]) == (0, "send", "TRANSFERRING")
        assert r["peer"] == f"tcp://127.0.0.1:{d.control_port}"
        assert r["prompt_len"] == 512 and r["targets"] == [0] and r["reported"] is False
        assert r["age_s"] > 0 and 0 < r["deadline_in_s"] <= 30 and r["duration_s"] is None
        assert [g["group"] for g in r["groups"]] == [0, 1, 2, 3]
        assert all(g["blocks"] > 0 and g["delivered"] is None for g in r["groups"])
        assert r["bytes"] == sum(g["bytes"] for g in r["groups"]) > 0
    recvs = {r["id"]: r for r in run.d_list["requests"]}
    for rid in run.batch.ids:
        r = recvs[rid]
        assert (r["side"], r["state"]) == ("recv", "PENDING")
        # The prefill engine id, when decode's engine passed it (the simulated one does not).
        assert r["peer"] in (None, cluster.sides["prefill"].engine_id)
        assert r["senders"] == {"0": "PENDING"} and r["targets"] is None
        assert [(g["delivered"], g["layers_sent"]) for g in r["groups"]] == [(False, None)] * 4
        assert 0 < r["deadline_in_s"] <= 30


def test_request_state_filter(run: Run, prefill: httpx.Client) -> None:
    assert run.p_transferring["count"] >= 3
    assert {r["state"] for r in run.p_transferring["requests"]} == {"TRANSFERRING"}
    assert run.d_pending["count"] >= 3
    assert {r["state"] for r in run.d_pending["requests"]} == {"PENDING"}
    assert prefill.get("/v1/requests", params={"side": "recv"}).json()["requests"] == []
    r = prefill.get("/v1/requests", params={"state": "finished"})
    assert r.status_code == 422
    assert "'PENDING', 'TRANSFERRING', 'DONE', 'FAILED', 'ABORTED' or 'EXPIRED'" in r.text


def test_request_lookup(run: Run, prefill: httpx.Client) -> None:
    live = run.p_one_live["entries"]
    assert run.p_one_live["id"] == "api-0"
    assert [(e["side"], e["state"]) for e in live] == [("send", "TRANSFERRING")]
    # After the run it is found in the history, final and reported.
    assert run.p_one_done.status_code == 200
    (done,) = run.p_one_done.json()["entries"]
    assert (done["state"], done["reported"]) == ("DONE", True)
    assert done["deadline_in_s"] is None and done["duration_s"] > 0 and done["error"] is None
    # The list shows ended requests only when asked, each (id, rank, side) once.
    assert "api-0" not in {r["id"] for r in prefill.get("/v1/requests").json()["requests"]}
    listed = prefill.get("/v1/requests", params={"ended": "true", "side": "send"}).json()
    keys = [(r["id"], r["rank"]) for r in listed["requests"]]
    assert ("api-0", 0) in keys and len(keys) == len(set(keys)) == listed["count"]
    missing = prefill.get("/v1/requests/no-such-request")
    assert missing.status_code == 404
    assert "no-such-request is not known" in missing.json()["detail"]


def test_abort(run: Run, prefill: httpx.Client, decode: httpx.Client) -> None:
    for r in (run.abort_without_token, run.abort_wrong_token):
        assert r.status_code == 401
        assert r.headers["www-authenticate"].startswith("Bearer")
        assert "token" in r.json()["detail"]
    assert run.abort_ok.status_code == 200, run.abort_ok.text
    body = run.abort_ok.json()
    assert body["id"] == "api-2" and body["aborted"] == [0]
    (entry,) = body["entries"]
    assert (entry["state"], entry["error"]) == ("ABORTED", "test abort")
    assert run.abort_again.status_code == 409
    assert "already ended: ABORTED on rank 0" in run.abort_again.json()["detail"]
    assert run.abort_done.status_code == 409
    assert "DONE" in run.abort_done.json()["detail"]
    assert prefill.post("/v1/requests/no-such/abort", headers=AUTH).status_code == 404
    # Decode heard of it; both engines were told ABORTED; the others completed, verified.
    assert run.d_aborted["entries"][0]["error"] == "prefill: test abort"
    (d_done,) = decode.get("/v1/requests/api-0").json()["entries"]
    assert d_done["state"] == "DONE" and d_done["senders"] == {"0": "DONE"}
    assert all(g["delivered"] for g in d_done["groups"])
    assert statuses(run.result["prefill"]) == {"api-0": "DONE", "api-1": "DONE", "api-2": "ABORTED"}
    assert statuses(run.result["decode"])["api-2"] == "ABORTED"
    assert sorted(run.result["decode"]["ranks"][0]["verified"]) == ["api-0", "api-1"]


def test_peers(run: Run, cluster: Cluster, prefill: httpx.Client, decode: httpx.Client) -> None:
    d = cluster.sides["decode"]
    d_status = decode.get("/v1/status").json()
    peers = prefill.get("/v1/peers").json()["peers"]
    (peer,) = [p for p in peers if p["endpoint"] == f"tcp://127.0.0.1:{d.control_port}"]
    assert peer["engine_id"] == d.engine_id
    assert peer["epoch"] == d_status["epoch"]
    assert peer["te_session"] == d_status["mooncake"]["session"]
    assert peer["ranks"] == [0] and peer["handshakes"] >= 1
    seen = datetime.fromisoformat(peer["last_handshake"])
    assert datetime.now(UTC) - timedelta(hours=1) < seen <= datetime.now(UTC)
    # Decode knows its prefill from the Hello (to ask it to drain), without a handshake of its
    # own; both heard from each other within the lease.
    (back,) = decode.get("/v1/peers").json()["peers"]
    p = cluster.sides["prefill"]
    assert back["endpoint"] == f"tcp://127.0.0.1:{p.control_port}"
    assert (back["engine_id"], back["ranks"], back["handshakes"]) == (p.engine_id, [], 0)
    assert 0 <= back["heard_s_ago"] < 5 and 0 <= peer["heard_s_ago"] < 5


def test_metrics(run: Run, prefill: httpx.Client, decode: httpx.Client) -> None:
    live = run.p_metrics_live
    assert value(live, "kvsidecar_requests_in_flight", side="send", state="TRANSFERRING") >= 3
    assert value(live, "kvsidecar_stream_queue_capacity", rank="0") == 64
    assert ("kvsidecar_stream_queue_depth", frozenset({("rank", "0")})) in live

    r = prefill.get("/metrics")
    assert r.headers["content-type"].startswith("text/plain")
    p = samples(r.text)
    for g in run.p_groups["groups"]:
        labels = {"group": str(g["index"]), "spec": g["spec"]}
        assert value(p, "kvsidecar_group_bytes_total", **labels) >= g["bytes"] > 0
        assert value(p, "kvsidecar_group_descriptors_total", **labels) >= g["descriptors"]
        assert value(p, "kvsidecar_group_transfers_total", status="ok", **labels) > 0
        assert value(p, "kvsidecar_group_transfers_total", status="failed", **labels) == 0
    assert value(p, "kvsidecar_requests_total", side="send", state="DONE") >= 2
    assert value(p, "kvsidecar_requests_total", side="send", state="ABORTED") >= 1
    assert value(p, "kvsidecar_layer_transfer_seconds_count") > 0
    assert value(p, "kvsidecar_layer_transfer_seconds_sum") > 0
    assert value(p, "kvsidecar_handshake_seconds_count") >= 1
    assert value(p, "kvsidecar_mooncake_bytes_total") == run.p_status["mooncake"]["bytes"]
    assert value(p, "kvsidecar_ready") == 1
    assert value(p, "kvsidecar_deadline_expirations_total") == 0
    for socket in ("control", "engine"):
        assert value(p, "kvsidecar_rejected_frames_total", socket=socket) == 0
    assert value(p, "kvsidecar_frames_total", socket="engine") > 0

    d = samples(decode.get("/metrics").text)
    assert value(d, "kvsidecar_requests_total", side="recv", state="DONE") >= 2
    assert value(d, "kvsidecar_requests_total", side="recv", state="ABORTED") >= 1
    assert value(d, "kvsidecar_frames_total", socket="control") > 0
    assert value(d, "kvsidecar_handshake_seconds_count") == 0
    assert all(name.startswith("kvsidecar_") for name, _ in d)


def test_openapi(prefill: httpx.Client) -> None:
    spec = prefill.get("/openapi.json").json()
    paths = spec["paths"]
    assert set(paths) == {
        "/livez",
        "/readyz",
        "/metrics",
        "/v1/status",
        "/v1/registration",
        "/v1/regions",
        "/v1/groups",
        "/v1/requests",
        "/v1/requests/{request_id}",
        "/v1/requests/{request_id}/abort",
        "/v1/kv_targets",
        "/v1/peers",
        "/v1/pool",
        "/v1/pool/lookup",
        "/v1/kv_digest",
    }
    digest = paths["/v1/kv_digest"]
    assert {"200", "401", "422"} <= set(digest["put"]["responses"])
    assert digest["put"]["security"] == [{"HTTPBearer": []}] and "security" not in digest["get"]
    abort = paths["/v1/requests/{request_id}/abort"]["post"]
    assert {"200", "401", "404", "409"} <= set(abort["responses"])
    assert abort["security"] == [{"HTTPBearer": []}]
    targets = paths["/v1/kv_targets"]["post"]
    assert {"200", "400", "401", "404", "409"} <= set(targets["responses"])
    assert targets["security"] == [{"HTTPBearer": []}]
    assert "503" in paths["/readyz"]["get"]["responses"]
    assert "404" in paths["/v1/requests/{request_id}"]["get"]["responses"]
    ok = paths["/v1/requests"]["get"]["responses"]["200"]["content"]["application/json"]
    assert ok["schema"]["$ref"] == "#/components/schemas/RequestList"
    assert "text/html" in prefill.get("/docs").headers["content-type"]


def test_pool_lookup_without_a_pool_says_how_to_enable_it(prefill: httpx.Client) -> None:
    # The lookup needs the admin token (test_pool_lookup_auth.py).
    r = prefill.post("/v1/pool/lookup", headers=AUTH, json={"token_ids": [1, 2, 3]})
    assert r.status_code == 409
    assert "KVSIDECAR_POOL__ENABLED" in r.json()["detail"]
    empty = prefill.post("/v1/pool/lookup", headers=AUTH, json={"token_ids": []})
    assert empty.status_code == 422
