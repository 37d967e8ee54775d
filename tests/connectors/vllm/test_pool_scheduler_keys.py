"""The scheduler hooks on vLLM's own ``Request`` objects (issue 50, items 1, 4 and 8): a pool
lookup asks with the whole prompt and vLLM's extra keys; a request with prompt embeddings goes
through without the pool and without a transfer, and never raises inside vLLM's scheduler; a
request that skips reading the prefix cache skips the pool's too. The sidecar's engine socket
is a real ZMQ socket that records what the hooks send."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import torch
from vllm.lora.request import LoRARequest
from vllm.sampling_params import SamplingParams
from vllm.v1.request import Request

from app.connectors.vllm.config import ConnectorConfig
from app.connectors.vllm.pool_keys import SKIP_EMBEDS
from app.connectors.vllm.scheduler import SchedulerSide
from app.transfer.wire.protocol import PoolLookup
from tests.connectors.vllm.conftest import Silent

PROMPT = list(range(1, 130))  # 8 blocks of 16 and one token


def vllm_request(
    rid: str,
    tokens: list[int] | None = PROMPT,
    params: dict[str, Any] | None = None,
    **kwargs: Any,
) -> Request:
    extra = {"kv_transfer_params": params} if params is not None else None
    sampling = SamplingParams(max_tokens=4, extra_args=extra, **kwargs.pop("sampling", {}))
    return Request(rid, tokens, sampling, None, **kwargs)


def side(silent: Silent, pool: bool = True) -> SchedulerSide:
    return SchedulerSide(ConnectorConfig(silent.endpoint, "e", 1, 1, None, 1.0, pool=pool))


def lookups(silent: Silent) -> list[PoolLookup]:
    return [m for m in silent.received(0.5) if isinstance(m, PoolLookup)]


def test_a_lookup_asks_with_the_whole_prompt_and_vllms_extra_keys(silent: Silent) -> None:
    s = side(silent)
    try:
        lora = LoRARequest("sql", 1, "/adapters/sql")
        assert s.get_num_new_matched_tokens(vllm_request("r", lora_request=lora), 0)[0] is None
        (asked,) = lookups(silent)
        # k blocks and one token: the sidecar may hit all k blocks (it leaves the last token).
        assert asked.token_ids == PROMPT
        assert asked.extra_keys == [(0, [["lora", "sql", "/adapters/sql"]])]
    finally:
        s.close()


def test_a_request_that_skips_reading_the_cache_skips_the_pool(silent: Silent) -> None:
    s = side(silent)
    try:
        r = vllm_request("r", sampling={"skip_reading_prefix_cache": True})
        assert s.get_num_new_matched_tokens(r, 0) == (0, False)
        assert lookups(silent) == []
    finally:
        s.close()


def _embeds(rid: str, ids: list[int] | None, params: dict[str, Any]) -> Request:
    return vllm_request(rid, ids, params, prompt_embeds=torch.zeros(len(PROMPT), 8))


def test_prompt_embeds_go_without_the_pool_and_without_a_transfer(silent: Silent) -> None:
    s = side(silent)
    try:
        prefill = {"do_remote_decode": True, "router_url": "http://r", "transfer_id": "t"}
        decode = {"do_remote_prefill": True, "router_url": "http://r", "transfer_id": "t"}
        for i, (ids, params) in enumerate(
            [(None, prefill), (None, decode), (list(PROMPT), prefill), (None, {})]
        ):
            r = _embeds(f"r{i}", ids, params)
            started = time.monotonic()
            assert s.get_num_new_matched_tokens(r, 0) == (0, False)
            assert time.monotonic() - started < 0.05  # and no waiting on the sidecar
            # Embeds and ids together: nothing truncated (the embeds would be one longer).
            assert r.prompt_token_ids == ids and r.num_prompt_tokens == len(PROMPT)
            s.update_state_after_alloc(r, _Blocks(), 0)
            assert r.request_id not in s.state.sends and r.request_id not in s.state.recvs
        assert s.skips == {SKIP_EMBEDS: 4}
        assert lookups(silent) == []
        # The next step's metadata carries them once (rank 0 counts them in vLLM's stats).
        assert s.build_connector_meta(_empty_step()).skipped == [SKIP_EMBEDS] * 4
        assert s.build_connector_meta(_empty_step()).skipped == []
    finally:
        s.close()


def _empty_step() -> SimpleNamespace:
    cached = SimpleNamespace(req_ids=[], new_block_ids=[], num_computed_tokens=[])
    return SimpleNamespace(
        total_num_scheduled_tokens=0,
        scheduled_new_reqs=[],
        scheduled_cached_reqs=cached,
        num_scheduled_tokens={},
        preempted_req_ids=None,
    )


class _Blocks:
    def get_block_ids(self) -> tuple[list[int], ...]:
        return ([1, 2, 3, 4, 5, 6, 7, 8, 9],)
