"""The decode target's hop: decode's scheduler builds a RemoteTarget, it travels as JSON
(through the proxy, untouched), prefill's scheduler reads it back in one place or refuses it.

No engine here: the scheduler side with fake requests and a fake engine link (fast).
"""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest

from app.connectors.vllm.config import ConnectorConfig
from app.connectors.vllm.scheduler import SchedulerSide
from app.transfer.protocol import RemoteTarget

CONFIG = ConnectorConfig("ipc:///nowhere", "e", 1, 1, None, 1.0)
TARGET = RemoteTarget("d-req", "10.0.0.2", 5600, "d", "ep", 1, [[3, 4]])


class Blocks:
    def get_block_ids(self) -> tuple[list[int], ...]:
        return ([3, 4],)


class Link:
    rank = 0

    def expect_receive(self, *args: Any, **kw: Any) -> None:
        pass

    def sidecar_info(self) -> dict[str, Any]:
        return {"host": "10.0.0.2", "port": 5600, "engine_id": "d", "epoch": "ep", "ready": True}


def request(rid: str, params: dict[str, Any]) -> SimpleNamespace:
    return SimpleNamespace(request_id=rid, kv_transfer_params=params, prompt_token_ids=[1, 2, 3])


def over_http(obj: Any) -> Any:
    """What the proxy relays: the posted JSON, read back as plain objects."""
    return msgspec.json.decode(msgspec.json.encode(obj))


def test_decode_builds_the_target_prefill_reads() -> None:
    decode = SchedulerSide(CONFIG)
    decode._links = [Link()]  # type: ignore[list-item]
    params = {"do_remote_prefill": True, "router_url": "http://r/v1/kv_targets", "transfer_id": "t"}
    decode.update_state_after_alloc(request("d-req", params), Blocks(), 2)
    (posted,) = decode.state.targets
    assert posted.transfer_id == "t" and posted.target == TARGET

    prefill = SchedulerSide(CONFIG)
    remote = over_http(msgspec.to_builtins(posted.target))
    prefill.update_state_after_alloc(
        request("p-req", {"do_remote_decode": True, "remote": remote}), Blocks(), 0
    )
    send = prefill.state.sends["p-req"]
    assert send.sid == "d-req" and send.remote == TARGET


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
            request("p-req", {"do_remote_decode": True, "remote": over_http(raw)}), Blocks(), 0
        )
    assert prefill.state.sends == {}
    assert "p-req" in caplog.text and "invalid remote target" in caplog.text
    assert where in caplog.text and "not sent" in caplog.text
