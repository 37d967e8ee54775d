"""Under pipeline parallel each stage is an engine with a sidecar of its own, holding its own
layers of every request: an abort from vLLM's scheduler (one per engine, for all stages) must
reach every rank of every stage, or the stages not told keep their sends and expects until
their deadlines. Here each stage's engine socket is a real ZMQ socket that reads and never
answers: aborts are one-way, so that is all the scheduler needs."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

pytest.importorskip("vllm", reason="the scheduler side is vLLM's connector")

from vllm.sampling_params import SamplingParams
from vllm.v1.request import Request, RequestStatus

from app.connectors.vllm.config import PP_PLACEHOLDER, ConnectorConfig
from app.connectors.vllm.scheduler import SchedulerSide
from app.transfer.wire.codec import decode
from app.transfer.wire.protocol import AbortRequest

PP, TP = 2, 2


class Blocks:
    def get_block_ids(self) -> tuple[list[int], ...]:
        return ([1, 2, 3, 4],)


@pytest.fixture
def stage_sockets(tmp_path: Path) -> Iterator[tuple[str, list[zmq.Socket[bytes]]]]:
    """Each stage's engine endpoint (``{pp}`` filled in) bound by a ROUTER that never answers."""
    ctx = zmq.Context()
    template = f"ipc://{tmp_path}/engine-pp{PP_PLACEHOLDER}.ipc"
    socks = []
    for stage in range(PP):
        sock = ctx.socket(zmq.ROUTER)
        sock.bind(template.replace(PP_PLACEHOLDER, str(stage)))
        socks.append(sock)
    yield template, socks
    for sock in socks:
        sock.close(linger=0)
    ctx.term()


def _aborts(sock: zmq.Socket[bytes], timeout_s: float = 2.0) -> list[AbortRequest]:
    """Every abort that arrived, waiting up to ``timeout_s`` for the first."""
    out: list[Any] = []
    while sock.poll(int(timeout_s * 1000)):
        *_, payload = sock.recv_multipart()
        out.append(decode(payload))
        timeout_s = 0.1
    return [m for m in out if isinstance(m, AbortRequest)]


def test_an_aborted_request_is_aborted_on_every_rank_of_every_stage(
    stage_sockets: tuple[str, list[zmq.Socket[bytes]]],
) -> None:
    template, socks = stage_sockets
    config = ConnectorConfig(template, "d", TP, TP, None, 1.0, pp_size=PP)
    side = SchedulerSide(config)
    params = {"do_remote_prefill": True, "transfer_id": "t", "router_url": "http://r/x"}
    sampling = SamplingParams(extra_args={"kv_transfer_params": params})
    req = Request("d", list(range(1, 65)), sampling, None)
    try:
        count, _ = side.get_num_new_matched_tokens(req, 0)
        assert count is not None
        side.update_state_after_alloc(req, Blocks(), count)
        req.status = RequestStatus.FINISHED_ABORTED
        side.request_finished(req, ([1, 2, 3, 4],))
        told = [sorted((m.request, m.rank) for m in _aborts(sock)) for sock in socks]
        assert told == [[("t", 0), ("t", 1)]] * PP, told
    finally:
        side.close()
