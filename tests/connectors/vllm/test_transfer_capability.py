"""The connector's half of the proxy's per-transfer capability and of the "recomputed" record:
the token in ``kv_transfer_params`` reaches both target calls as a header (over real HTTP), and
decode's finished request says whether prefill's KV was used or recomputed. Under pipeline
parallel both calls name the stage, and decode first each stage sends to its own target. A
worker's calls share one kept-alive connection (a client per call cost ~50 ms each)."""

from __future__ import annotations

import dataclasses
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace
from typing import Any

import httpx
import msgspec
import pytest
from vllm.sampling_params import SamplingParams
from vllm.v1.request import Request, RequestStatus

from app.connectors.params import KV_LOAD_PARAM, TRANSFER_TOKEN_HEADER, TRANSFER_TOKEN_PARAM
from app.connectors.vllm.config import ConnectorConfig
from app.connectors.vllm.router_calls import fetch_target, post_target, router_client
from app.connectors.vllm.scheduler import SchedulerSide
from app.transfer.wire.protocol import RemoteTarget

CONFIG = ConnectorConfig("ipc:///nowhere", "e", 1, 1, None, 1.0)
TARGET = RemoteTarget("t", "10.0.0.2", 5600, "d", "ep", 1, [[3, 4]], signature="a" * 64)


class Blocks:
    def get_block_ids(self) -> tuple[list[int], ...]:
        return ([3, 4],)


def request(rid: str, params: dict[str, Any]) -> Request:
    """vLLM's own request, as its scheduler hands it to the hooks (finished, when asked)."""
    req = Request(rid, [1, 2, 3], SamplingParams(extra_args={"kv_transfer_params": params}), None)
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    req.num_computed_tokens = 3
    return req


def first_step(rid: str) -> SimpleNamespace:
    """vLLM's scheduler output of a new request's first step: its whole 3-token prompt."""
    return SimpleNamespace(
        scheduled_new_reqs=[
            SimpleNamespace(req_id=rid, num_computed_tokens=0, block_ids=([3, 4],))
        ],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[], new_block_ids=[]),
        num_scheduled_tokens={rid: 3},
        total_num_scheduled_tokens=3,
        preempted_req_ids=None,
    )


class Router(ThreadingHTTPServer):
    """A router on loopback that answers every call with decode's target and keeps the
    capability header each call carried."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str | None]] = []
        self.paths: list[str] = []  # path and query of each call
        self.bodies: list[dict[str, Any]] = []  # each POST's
        self.peers: list[tuple[str, int]] = []  # the client's address of each call
        super().__init__(("127.0.0.1", 0), _Handler)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/v1/kv_targets"


class _Handler(BaseHTTPRequestHandler):
    server: Router
    protocol_version = "HTTP/1.1"  # keep-alive, as uvicorn answers

    def _answer(self) -> None:
        self.server.peers.append(self.client_address)
        self.server.seen.append((self.command, self.headers.get(TRANSFER_TOKEN_HEADER)))
        self.server.paths.append(self.path)
        body = json.dumps({"target": msgspec.to_builtins(TARGET)}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        self._answer()

    def do_POST(self) -> None:
        self.server.bodies.append(json.loads(self.rfile.read(int(self.headers["content-length"]))))
        self._answer()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def router() -> Iterator[Router]:
    server = Router()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture
def client() -> Iterator[httpx.Client]:
    with router_client() as c:
        yield c


def test_token_reaches_both_target_calls_as_a_header(router: Router, client: httpx.Client) -> None:
    post_target(client, router.url, "t", TARGET, "cap-1")
    assert fetch_target(client, router.url, "t", 5.0, "cap-2") == TARGET
    # A router that gave none (the prefill-first flow).
    post_target(client, router.url, "t", TARGET)
    assert router.seen == [("POST", "cap-1"), ("GET", "cap-2"), ("POST", None)]


def test_a_workers_calls_share_one_connection(router: Router, client: httpx.Client) -> None:
    for _ in range(3):
        post_target(client, router.url, "t", TARGET)
        fetch_target(client, router.url, "t", 5.0)
    assert len(router.peers) == 6 and len(set(router.peers)) == 1


def test_scheduler_carries_the_token_to_both_sides_workers() -> None:
    decode, prefill = SchedulerSide(CONFIG), SchedulerSide(CONFIG)
    common = {"router_url": "http://r/v1/kv_targets", "transfer_id": "t"}
    d_req = request("d", {"do_remote_prefill": True, **common, TRANSFER_TOKEN_PARAM: "cap"})
    assert decode.get_num_new_matched_tokens(d_req, 0)[0] == 2  # all but the last token
    decode.update_state_after_alloc(d_req, Blocks(), 2)
    (expect,) = decode.state.expects
    assert expect.token == "cap"
    p_req = request("p", {"do_remote_decode": True, **common, TRANSFER_TOKEN_PARAM: "cap"})
    prefill.update_state_after_alloc(p_req, Blocks(), 0)
    (admit,) = prefill.build_connector_meta(first_step("p")).admits
    assert admit.token == "cap"


@pytest.mark.parametrize("failed", [False, True])
def test_decode_says_whether_it_used_prefill_kv(failed: bool) -> None:
    decode = SchedulerSide(CONFIG)
    req = request("d", {"do_remote_prefill": True, "transfer_id": "t", "router_url": "http://r"})
    decode.get_num_new_matched_tokens(req, 0)
    decode.update_state_after_alloc(req, Blocks(), 2)
    decode.update_connector_output(
        SimpleNamespace(failed_recving={"d"} if failed else set(), finished_sending=None)
    )
    _, params = decode.request_finished(req, ([3, 4],))
    assert params is not None
    assert params[KV_LOAD_PARAM] == ("failed" if failed else "ok")
    assert TRANSFER_TOKEN_PARAM not in params  # decode's answer goes to the client


def test_pipeline_stages_name_themselves_in_both_target_calls(
    router: Router, client: httpx.Client
) -> None:
    """Stage 1 of 2: the post carries it (and fills in ``{pp}``: prefill first, the URL of
    prefill's stage-1 sidecar), and the fetch asks for stage 1's target."""
    post_target(client, router.url + "/pp{pp}", "t", TARGET, stage=1, pp_size=2)
    fetch_target(client, router.url, "t", 5.0, stage=1, pp_size=2)
    post_target(client, router.url, "t", TARGET)  # without PP: the body stays as it was
    assert router.paths[0] == "/v1/kv_targets/pp1"
    assert "pp_stage=1" in router.paths[1] and "pp_size=2" in router.paths[1]
    assert router.bodies[0]["pp_stage"] == 1 and router.bodies[0]["pp_size"] == 2
    assert "pp_stage" not in router.bodies[1]


def _decode_first_admit(config: ConnectorConfig, stages: int) -> list[Any]:
    prefill = SchedulerSide(config)
    targets = [
        msgspec.to_builtins(msgspec.structs.replace(TARGET, port=5600 + s)) for s in range(stages)
    ]
    params = {
        "do_remote_decode": True,
        "transfer_id": "t",
        "remote": targets[0],
        "remote_stages": targets,
    }
    prefill.update_state_after_alloc(request("p", params), Blocks(), 0)
    return list(prefill.build_connector_meta(first_step("p")).admits)


def test_decode_first_each_prefill_stage_sends_to_its_own_target() -> None:
    two = dataclasses.replace(CONFIG, pp_size=2)
    (admit,) = _decode_first_admit(two, 2)
    sends = [admit.for_stage(rank=0, stage=s) for s in (0, 1)]
    assert [s.remote.port for s in sends if s.remote is not None] == [5600, 5601]


def test_decode_first_with_other_stage_counts_sends_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    assert _decode_first_admit(CONFIG, 2) == []  # prefill PP 1, decode PP 2
    assert "decode runs 2 pipeline stage(s) and this prefill 1" in caplog.text
