"""Decode's connector says why it recomputed (issue 51): a worker's reason for a failed load
(``PoolSavesDone.load_errors``, with the step's ``failed_recving``) reaches the request's final
``kv_transfer_params`` as ``kv_load_error``, which the proxy reads."""

from __future__ import annotations

import pytest
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import RequestStatus

from app.connectors.params import KV_DIGEST_MISMATCH, KV_LOAD_FAILED
from app.connectors.vllm.config import ConnectorConfig
from app.connectors.vllm.metadata import PoolSavesDone
from app.connectors.vllm.scheduler import SchedulerSide
from tests.connectors.vllm.conftest import Silent
from tests.connectors.vllm.test_scheduler_hooks import Blocks, request


@pytest.mark.parametrize("why", [KV_DIGEST_MISMATCH, KV_LOAD_FAILED, None])
def test_a_failed_load_names_its_reason(silent: Silent, why: str | None) -> None:
    side = SchedulerSide(ConnectorConfig(silent.endpoint, "e", 1, 1, None, 1.0))
    try:
        params = {"do_remote_prefill": True, "transfer_id": "t", "router_url": "http://r/x"}
        reqs = {rid: request(rid, params) for rid in ("d", "ok")}
        for req in reqs.values():
            count, _ = side.get_num_new_matched_tokens(req, 0)
            assert count is not None  # a decode request's count is known at once
            side.update_state_after_alloc(req, Blocks(), count)
        errors = {} if why is None else {"d": why, "ok": KV_DIGEST_MISMATCH}
        # "ok" loaded: a reason named for a request that did not fail is not its reason.
        side.update_connector_output(
            KVConnectorOutput(
                finished_recving={"d", "ok"},
                failed_recving={"d"},
                kv_connector_worker_meta=PoolSavesDone({}, errors),
            )
        )
        out = {}
        for rid, req in reqs.items():
            req.status = RequestStatus.FINISHED_STOPPED
            _, out[rid] = side.request_finished(req, ([1, 2, 3, 4],))
        reason = {} if why is None else {"kv_load_error": why}
        assert out["d"] == {"kv_sidecar_request_id": "t", "kv_load": "failed", **reason}
        assert out["ok"] == {"kv_sidecar_request_id": "t", "kv_load": "ok"}
    finally:
        side.close()


def test_workers_reports_merge_with_the_digest_first() -> None:
    """TP ranks each report their step: a mismatch on any rank is the request's reason."""
    a = PoolSavesDone({"s": 1}, {"r1": KV_LOAD_FAILED, "r2": KV_DIGEST_MISMATCH})
    b = PoolSavesDone({"s": 1}, {"r1": KV_DIGEST_MISMATCH, "r2": KV_LOAD_FAILED, "r3": "x"})
    for merged in (a.aggregate(b), b.aggregate(a)):
        assert isinstance(merged, PoolSavesDone)
        assert merged.saves == {"s": 2}
        assert merged.load_errors["r1"] == merged.load_errors["r2"] == KV_DIGEST_MISMATCH
        assert merged.load_errors["r3"] == "x"
