"""Decode's stage k takes the layers of prefill's stage k, so a prefill that runs more pipeline
stages than decode has layers no decode stage would take: decode first, it sends nothing and
says why (the reverse, decode with more stages, is tests/connectors/vllm/
test_transfer_capability.py's). Decode's one-stage target comes as the proxy sends it (only
``remote``) or as a list of one."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import msgspec
import pytest

pytest.importorskip("vllm", reason="the scheduler side is vLLM's connector")

from vllm.sampling_params import SamplingParams
from vllm.v1.request import Request, RequestStatus

from app.connectors.vllm.config import ConnectorConfig
from app.connectors.vllm.scheduler import SchedulerSide
from app.transfer.wire.protocol import RemoteTarget

PREFILL_TWO_STAGES = ConnectorConfig("ipc:///nowhere-{pp}", "p", 1, 1, None, 1.0, pp_size=2)
TARGET = RemoteTarget("t", "10.0.0.2", 5600, "d", "ep", 1, [[3, 4]], signature="a" * 64)


class Blocks:
    def get_block_ids(self) -> tuple[list[int], ...]:
        return ([3, 4],)


def _admits(config: ConnectorConfig, params: dict[str, Any]) -> list[Any]:
    """What the scheduler admits in the first step of a 3-token prompt sent with ``params``."""
    side = SchedulerSide(config)
    req = Request("p", [1, 2, 3], SamplingParams(extra_args={"kv_transfer_params": params}), None)
    req.status = RequestStatus.RUNNING
    side.update_state_after_alloc(req, Blocks(), 0)
    step = SimpleNamespace(
        scheduled_new_reqs=[
            SimpleNamespace(req_id="p", num_computed_tokens=0, block_ids=([3, 4],))
        ],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[], new_block_ids=[]),
        num_scheduled_tokens={"p": 3},
        total_num_scheduled_tokens=3,
        preempted_req_ids=None,
    )
    return list(side.build_connector_meta(step).admits)


@pytest.mark.parametrize("shape", ["remote only", "one remote_stages"])
def test_prefill_with_more_stages_than_decode_sends_nothing(
    caplog: pytest.LogCaptureFixture, shape: str
) -> None:
    one = msgspec.to_builtins(TARGET)
    params: dict[str, Any] = {"do_remote_decode": True, "transfer_id": "t", "remote": one}
    if shape == "one remote_stages":
        params["remote_stages"] = [one]
    assert _admits(PREFILL_TWO_STAGES, params) == []
    assert "decode runs 1 pipeline stage(s) and this prefill 2" in caplog.text


def test_prefill_with_as_many_stages_as_decode_sends() -> None:
    """The same request with decode's two stages is admitted: the refusal above is the count's."""
    two = [msgspec.to_builtins(msgspec.structs.replace(TARGET, port=5600 + s)) for s in (0, 1)]
    params = {"do_remote_decode": True, "transfer_id": "t", "remote": two[0], "remote_stages": two}
    (admit,) = _admits(PREFILL_TWO_STAGES, params)
    assert [r.port for r in admit.stage_remotes] == [5600, 5601]
