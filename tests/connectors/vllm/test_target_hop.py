"""The decode target's hop: decode's connector builds a RemoteTarget, it travels as JSON
(through the proxy, untouched), prefill's scheduler reads it back in one place or refuses it;
concurrent, prefill admits without it and its workers fetch it by the transfer id.

No engine here: the scheduler side with fake requests (fast). The scheduler side never calls
the sidecar in these hooks, so no engine link is needed.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest
from vllm.lora.request import LoRARequest
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.sampling_params import SamplingParams
from vllm.v1.request import Request

from app.connectors.vllm.config import ConnectorConfig
from app.connectors.vllm.scheduler import SchedulerSide
from app.connectors.vllm.worker import decode_target
from app.transfer.wire.protocol import RemoteTarget
from app.transfer.wire.target_auth import prompt_digest

CONFIG = ConnectorConfig("ipc:///nowhere", "e", 1, 1, None, 1.0)
TARGET = RemoteTarget(
    "t",
    "10.0.0.2",
    5600,
    "d",
    "ep",
    1,
    [[3, 4]],
    computed=1,
    prompt_digest=prompt_digest([1, 2, 3]),
)
INFO = {"host": "10.0.0.2", "port": 5600, "engine_id": "d", "epoch": "ep", "ready": True}
ROUTER = "http://r/v1/kv_targets"


class Blocks:
    def get_block_ids(self) -> tuple[list[int], ...]:
        return ([3, 4],)


def request(rid: str, params: dict[str, Any], **kwargs: Any) -> Request:
    """vLLM's own request, as its scheduler hands it to the hooks."""
    sampling = SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": params})
    return Request(rid, [1, 2, 3], sampling, None, **kwargs)


def over_http(obj: Any) -> Any:
    """What the proxy relays: the posted JSON, read back as plain objects."""
    return msgspec.json.decode(msgspec.json.encode(obj))


def test_decode_builds_the_target_prefill_reads() -> None:
    decode = SchedulerSide(CONFIG)
    params = {"do_remote_prefill": True, "router_url": ROUTER, "transfer_id": "t"}
    req = request("d-req", params)
    # Decode's own prefix cache holds 1 of the 3 tokens: it loads 1, prefill skips the first.
    assert decode.get_num_new_matched_tokens(req, 1) == (1, True)
    decode.update_state_after_alloc(req, Blocks(), 1)
    (expect,) = decode.state.expects
    assert (expect.req_id, expect.recv.request, expect.computed) == ("d-req", "t", 1)
    posted = decode_target(expect, INFO, 1)
    assert posted == TARGET

    prefill = SchedulerSide(CONFIG)
    remote = over_http(msgspec.to_builtins(posted))
    prefill.update_state_after_alloc(
        request("p-req", {"do_remote_decode": True, "transfer_id": "t", "remote": remote}),
        Blocks(),
        0,
    )
    send = prefill.state.sends["p-req"]
    assert send.sid == "t" and send.remote == TARGET
    # Prefill's engine runs the prompt decode holds: the target's digest is the send's.
    assert send.prompt_digest == TARGET.prompt_digest


def test_concurrent_prefill_admits_without_a_target_by_transfer_id() -> None:
    prefill = SchedulerSide(CONFIG)
    params = {"do_remote_decode": True, "router_url": ROUTER, "transfer_id": "t"}
    prefill.update_state_after_alloc(request("p-req", params), Blocks(), 0)
    send = prefill.state.sends["p-req"]
    assert (send.sid, send.remote, send.router_url) == ("t", None, ROUTER)


def test_prefill_with_neither_target_nor_router_is_not_sent(
    caplog: pytest.LogCaptureFixture,
) -> None:
    prefill = SchedulerSide(CONFIG)
    with caplog.at_level(logging.ERROR):
        prefill.update_state_after_alloc(
            request("p-req", {"do_remote_decode": True, "transfer_id": "t"}), Blocks(), 0
        )
    assert prefill.state.sends == {} and "router_url" in caplog.text


@pytest.mark.parametrize(
    ("field", "value", "where"),
    [("port", "5600", "$.port"), ("block_ids", [[-1]], "$.block_ids[0][0]")],
)
def test_bad_target_is_not_sent_and_the_log_says_why(
    caplog: pytest.LogCaptureFixture, field: str, value: Any, where: str
) -> None:
    raw = msgspec.to_builtins(TARGET)
    raw[field] = value
    prefill = SchedulerSide(CONFIG)
    with caplog.at_level(logging.ERROR):
        prefill.update_state_after_alloc(
            request(
                "p-req", {"do_remote_decode": True, "transfer_id": "t", "remote": over_http(raw)}
            ),
            Blocks(),
            0,
        )
    assert prefill.state.sends == {}
    assert "p-req" in caplog.text and "invalid remote target" in caplog.text
    assert where in caplog.text and "not sent" in caplog.text


def _prefill_request(rid: str, params: dict[str, Any]) -> Request:
    """A prefill request as vLLM's scheduler holds it: the prompt twice (``_truncate`` cuts
    both)."""
    return request(rid, params)


def test_prefill_binds_the_whole_prompt_and_the_transfer_id_it_runs_under() -> None:
    """Prefill drops the prompt's last token before it computes (decode computes it), yet the
    send names the whole prompt as decode holds it, and the proxy's transfer id, not the
    target's own: the sidecar compares both with what decode signed."""
    prefill = SchedulerSide(CONFIG)
    remote = over_http(msgspec.to_builtins(msgspec.structs.replace(TARGET, request_id="other")))
    params = {"do_remote_decode": True, "transfer_id": "t", "remote": remote}
    req = _prefill_request("p-req", params)
    prefill.get_num_new_matched_tokens(req, 0)
    prefill.get_num_new_matched_tokens(req, 0)  # vLLM asks again until it schedules it
    assert req.prompt_token_ids == [1, 2] and req.num_prompt_tokens == 2
    prefill.update_state_after_alloc(req, Blocks(), 0)
    send = prefill.state.sends["p-req"]
    assert send.sid == "t" and send.prompt_len == 3
    assert send.prompt_digest == prompt_digest([1, 2, 3])
    step = SimpleNamespace(
        scheduled_new_reqs=[
            SimpleNamespace(req_id="p-req", num_computed_tokens=0, block_ids=([3, 4],))
        ],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[], new_block_ids=[]),
        num_scheduled_tokens={"p-req": 2},
        total_num_scheduled_tokens=2,
        preempted_req_ids=None,
    )
    (admit,) = prefill.build_connector_meta(step).admits
    assert admit.send.request == "t" and admit.send.prompt_digest == prompt_digest([1, 2, 3])


def test_a_client_marker_does_not_skip_the_cut() -> None:
    """``kv_transfer_params`` are the client's: a marker there must not keep the last token
    (nor change the digest the send names)."""
    prefill = SchedulerSide(CONFIG)
    params = {"do_remote_decode": True, "transfer_id": "t", "_kvs_truncated": True}
    req = _prefill_request("p-req", {**params, "remote": over_http(msgspec.to_builtins(TARGET))})
    prefill.get_num_new_matched_tokens(req, 0)
    assert req.prompt_token_ids == [1, 2]


def test_decode_first_without_the_transfer_id_is_not_sent(
    caplog: pytest.LogCaptureFixture,
) -> None:
    prefill = SchedulerSide(CONFIG)
    remote = over_http(msgspec.to_builtins(TARGET))
    with caplog.at_level(logging.ERROR):
        prefill.update_state_after_alloc(
            request("p-req", {"do_remote_decode": True, "remote": remote}), Blocks(), 0
        )
    assert prefill.state.sends == {} and "without the transfer_id" in caplog.text


def test_the_digest_binds_the_adapter_and_the_images_too() -> None:
    """The same ids under another adapter, or with another image behind the placeholders, are
    other KV: a target signed for one is not the other's."""
    decode = SchedulerSide(CONFIG)
    params = {"do_remote_prefill": True, "router_url": ROUTER, "transfer_id": "t"}
    image = MultiModalFeatureSpec(None, "image", "img-1", PlaceholderRange(0, 2))
    other = MultiModalFeatureSpec(None, "image", "img-2", PlaceholderRange(0, 2))
    digests = []
    for kwargs in (
        {},
        {"lora_request": LoRARequest("a", 1, "/adapters/a")},
        {"lora_request": LoRARequest("a", 1, "/adapters/a-v2")},
        {"mm_features": [image]},
        {"mm_features": [other]},
    ):
        req = request(f"d-{len(digests)}", params, **kwargs)
        decode.get_num_new_matched_tokens(req, 0)
        decode.update_state_after_alloc(req, Blocks(), 2)
        digests.append(decode.state.expects[-1].recv.prompt_digest)
    assert digests[0] == prompt_digest([1, 2, 3])
    assert len(set(digests)) == len(digests), digests


def test_decode_signs_the_prompt_it_holds() -> None:
    decode = SchedulerSide(CONFIG)
    params = {"do_remote_prefill": True, "router_url": ROUTER, "transfer_id": "t"}
    req = request("d-req", params)
    decode.get_num_new_matched_tokens(req, 0)
    decode.update_state_after_alloc(req, Blocks(), 2)
    (expect,) = decode.state.expects
    assert expect.recv.prompt_digest == prompt_digest([1, 2, 3])
    assert decode_target(expect, INFO, 1).prompt_digest == prompt_digest([1, 2, 3])
