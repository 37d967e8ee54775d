"""The scheduler takes the proxy's ``traceparent`` from ``kv_transfer_params`` into the
worker's ``Expect`` (decode) and ``Admit`` (prefill); a malformed one is dropped, not sent."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from vllm.sampling_params import SamplingParams
from vllm.v1.request import Request

from app.connectors.vllm.config import ConnectorConfig
from app.connectors.vllm.scheduler import SchedulerSide

TP = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


class Blocks:
    def get_block_ids(self) -> tuple[list[int], ...]:
        return ([1, 2, 3, 4],)


def _side() -> SchedulerSide:
    # Never dialled: these hooks make no sidecar call.
    return SchedulerSide(ConnectorConfig("ipc:///nonexistent", "e", 1, 1, None, 1.0))


def _request(rid: str, params: dict[str, Any]) -> Request:
    """vLLM's own request, as its scheduler hands it to the hooks."""
    sampling = SamplingParams(extra_args={"kv_transfer_params": params})
    return Request(rid, list(range(1, 65)), sampling, None)


@pytest.mark.parametrize(("given", "passed"), [(TP, TP), ("00-not-a-traceparent", None)])
def test_decode_expect_carries_the_traceparent(given: str, passed: str | None) -> None:
    side = _side()
    params = {"do_remote_prefill": True, "transfer_id": "t", "router_url": "http://r/x"}
    req = _request("d", {**params, "traceparent": given})
    count, _ = side.get_num_new_matched_tokens(req, 0)
    side.update_state_after_alloc(req, Blocks(), count)
    (expect,) = side.state.expects
    assert (expect.recv.request, expect.recv.traceparent) == ("t", passed)


@pytest.mark.parametrize(("given", "passed"), [(TP, TP), (TP.upper(), None)])
def test_prefill_admit_carries_the_traceparent(given: str, passed: str | None) -> None:
    side = _side()
    params = {"do_remote_decode": True, "transfer_id": "t", "router_url": "http://r/x"}
    req = _request("p", {**params, "traceparent": given})
    req.num_prompt_tokens = len(req.prompt_token_ids)
    req._all_token_ids = list(req.prompt_token_ids)
    side.get_num_new_matched_tokens(req, 0)
    side.update_state_after_alloc(req, Blocks(), 0)
    out = SimpleNamespace(
        scheduled_new_reqs=[
            SimpleNamespace(req_id="p", block_ids=([1, 2, 3, 4],), num_computed_tokens=0)
        ],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[], new_block_ids=[]),
        num_scheduled_tokens={"p": 63},
        total_num_scheduled_tokens=63,
        preempted_req_ids=None,
    )
    (admit,) = side.build_connector_meta(out).admits
    assert (admit.send.request, admit.send.traceparent) == ("t", passed)
