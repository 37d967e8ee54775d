"""vLLM calls the scheduler hooks inside its scheduler loop: they must never wait on the
sidecar. Here the sidecar's engine socket is a real ZMQ socket that takes every frame and
never answers (a hung sidecar): a pool lookup answers "not known yet" (None) at once, each
step, until the lookup gives up at the link timeout and the request computes itself; a decode
request's admission makes no sidecar call at all (its workers expect it).
"""

from __future__ import annotations

import time
from typing import Any

from vllm.sampling_params import SamplingParams
from vllm.v1.request import Request, RequestStatus

from app.connectors.vllm.config import ConnectorConfig
from app.connectors.vllm.scheduler import SchedulerSide
from app.transfer.wire.protocol import AbortRequest
from tests.connectors.vllm.conftest import Silent

LINK_TIMEOUT_S = 1.0
HOOK_BUDGET_S = 0.05  # far below one link timeout: the hook did not wait on the socket


def request(rid: str, params: dict[str, Any] | None = None) -> Request:
    """vLLM's own request, as its scheduler hands it to the hooks."""
    extra = None if params is None else {"kv_transfer_params": params}
    return Request(rid, list(range(1, 65)), SamplingParams(max_tokens=1, extra_args=extra), None)


class Blocks:
    def get_block_ids(self) -> tuple[list[int], ...]:
        return ([1, 2, 3, 4],)


def timed(fn: Any, *args: Any) -> tuple[Any, float]:
    t0 = time.monotonic()
    out = fn(*args)
    return out, time.monotonic() - t0


def test_pool_lookup_never_holds_the_scheduler(silent: Silent) -> None:
    config = ConnectorConfig(silent.endpoint, "e", 1, 1, None, LINK_TIMEOUT_S, pool=True)
    side = SchedulerSide(config)
    try:
        answers, slowest = [], 0.0
        t0 = time.monotonic()
        while time.monotonic() - t0 < LINK_TIMEOUT_S * 5:
            # One scheduler step each: vLLM asks again while the answer is None.
            got, took = timed(side.get_num_new_matched_tokens, request("r"), 0)
            answers.append(got)
            slowest = max(slowest, took)
            if got[0] is not None:
                break
            time.sleep(0.01)
        assert slowest < HOOK_BUDGET_S, slowest
        assert answers[0] == (None, False)
        # The lookup gave up at the link timeout: the request computes its prompt itself.
        assert answers[-1] == (0, False), answers[-3:]
        assert time.monotonic() - t0 >= LINK_TIMEOUT_S * 0.9
        # Meanwhile another request is answered at once too.
        got, took = timed(side.get_num_new_matched_tokens, request("other"), 0)
        assert got == (None, False) and took < HOOK_BUDGET_S
    finally:
        side.close()


def test_decode_admission_makes_no_sidecar_call(silent: Silent) -> None:
    side = SchedulerSide(ConnectorConfig(silent.endpoint, "e", 1, 1, None, LINK_TIMEOUT_S))
    params = {"do_remote_prefill": True, "transfer_id": "t", "router_url": "http://r/x"}
    req = request("d", params)
    try:
        (count, load), took = timed(side.get_num_new_matched_tokens, req, 0)
        assert (count, load) == (63, True) and took < HOOK_BUDGET_S
        _, took = timed(side.update_state_after_alloc, req, Blocks(), count)
        assert took < HOOK_BUDGET_S
        (expect,) = side.state.expects  # the workers expect it on their own ranks
        assert (expect.recv.request, expect.recv.prompt_len) == ("t", 64)
        # An abort goes one-way: it does not wait for the silent sidecar either.
        req.status = RequestStatus.FINISHED_ABORTED
        _, took = timed(side.request_finished, req, ([1, 2, 3, 4],))
        assert took < HOOK_BUDGET_S
        (abort,) = [m for m in silent.received() if isinstance(m, AbortRequest)]
        assert abort.request == "t" and "aborted" in abort.reason
    finally:
        side.close()
