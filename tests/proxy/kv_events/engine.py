"""vLLM's own KV cache manager and event publisher, without a model: what an engine's scheduler
does to its prefix cache (look up, allocate, cache, free, evict, reset) and publishes.

Events and hashes are vLLM's (sha256 block hashes, its int form on the wire, its block pool's
eviction order); ``held`` reads vLLM's own cache map, the truth the index is checked against.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec
import torch
from vllm.config.kv_events import KVEventsConfig
from vllm.distributed.kv_events import EventPublisher, EventPublisherFactory, KVEventBatch
from vllm.lora.request import LoRARequest
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import (
    get_request_block_hasher,
    init_none_hash,
    make_block_hash_with_group_id,
)
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    SlidingWindowSpec,
)
from vllm.v1.request import Request

from app.proxy.kv_events import wire

init_none_hash(sha256)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class Endpoints:
    """Where a publisher binds, and where a subscriber on this host finds it."""

    pub_port: int
    replay_port: int

    @classmethod
    def new(cls) -> Endpoints:
        return cls(free_port(), free_port())

    @property
    def sub(self) -> str:
        return f"tcp://127.0.0.1:{self.pub_port}"

    @property
    def replay(self) -> str:
        return f"tcp://127.0.0.1:{self.replay_port}"


def publisher(ends: Endpoints, topic: str = "kv", buffer_steps: int = 10_000) -> EventPublisher:
    """vLLM's ZMQ publisher from the config an engine gets from ``--kv-events-config``."""
    config = KVEventsConfig(
        enable_kv_cache_events=True,
        publisher="zmq",
        endpoint=f"tcp://*:{ends.pub_port}",
        replay_endpoint=f"tcp://127.0.0.1:{ends.replay_port}",
        buffer_steps=buffer_steps,
        topic=topic,
    )
    return EventPublisherFactory.create(config, data_parallel_rank=0)


def wait_ports_free(ends: Endpoints, timeout_s: float = 10.0) -> None:
    """Until a closed publisher's ports can be bound again (ZMQ closes listeners in its I/O
    thread, after ``close`` returned)."""
    deadline = time.monotonic() + timeout_s
    for port in (ends.pub_port, ends.replay_port):
        while True:
            with socket.socket() as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    s.bind(("", port))
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise
            time.sleep(0.05)


def full_attention(block_size: int = 16) -> FullAttentionSpec:
    return FullAttentionSpec(
        block_size=block_size, num_kv_heads=1, head_size=8, dtype=torch.float16
    )


def sliding_window(window: int, block_size: int = 16) -> SlidingWindowSpec:
    return SlidingWindowSpec(
        block_size=block_size,
        num_kv_heads=1,
        head_size=8,
        dtype=torch.float16,
        sliding_window=window,
    )


class CacheEngine:
    """One engine's prefix cache (vLLM's KVCacheManager), optionally publishing its events."""

    def __init__(
        self,
        num_blocks: int = 64,
        groups: Sequence[KVCacheSpec] | None = None,
        hash_block_size: int = 16,
        pub: EventPublisher | None = None,
    ) -> None:
        specs = list(groups) if groups else [full_attention(hash_block_size)]
        config = KVCacheConfig(
            num_blocks=num_blocks,
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec([f"layer{i}"], s) for i, s in enumerate(specs)],
        )
        self.specs = specs
        self.manager = KVCacheManager(
            config,
            max_model_len=4096,
            scheduler_block_size=max(s.block_size for s in specs),
            hash_block_size=hash_block_size,
            enable_kv_cache_events=True,
        )
        self.hasher = get_request_block_hasher(hash_block_size, sha256)
        self.hash_block_size = hash_block_size
        self.pub = pub
        self._n = 0

    def request(self, tokens: Sequence[int], salt: str | None = None, lora: str | None = None):
        self._n += 1
        return Request(
            f"r{self._n}",
            list(tokens),
            SamplingParams(max_tokens=1),
            None,
            block_hasher=self.hasher,
            cache_salt=salt,
            lora_request=None if lora is None else LoRARequest(lora, 1, f"/adapters/{lora}"),
        )

    def serve(
        self, tokens: Sequence[int], salt: str | None = None, lora: str | None = None
    ) -> None:
        """Prefill a prompt as the scheduler does (reuse its cached prefix, cache the rest in
        one step) and finish it; fails if the pool cannot hold it."""
        req = self.request(tokens, salt, lora)
        computed, hit, _ = self.manager.get_computed_blocks(req)
        blocks = self.manager.allocate_slots(req, len(tokens) - hit, hit, computed)
        assert blocks is not None, "the pool cannot hold this prompt"
        req.num_computed_tokens = len(tokens)
        self.manager.free(req)

    def serve_with_window_gap(self, tokens: Sequence[int], first: int) -> None:
        """Prefill ``tokens`` in two steps (``first`` tokens, then the rest) and finish it.

        With a sliding-window group, the blocks that left the window during the second step
        are freed mid-request, so they reach the free queue before the rest of the prompt's:
        the next prompt that needs room evicts them first, leaving the window group a gap
        full attention does not have (vLLM's coordinator then stops the hit before it)."""
        m = self.manager
        req = self.request(tokens)
        computed, hit, _ = m.get_computed_blocks(req)
        assert m.allocate_slots(req, first - hit, hit, computed) is not None
        req.num_computed_tokens = first
        assert m.allocate_slots(req, len(tokens) - first) is not None
        req.num_computed_tokens = len(tokens)
        m.free(req)

    def reset(self) -> None:
        assert self.manager.reset_prefix_cache()

    def publish(self) -> int:
        """Publish this step's events as one batch, as the scheduler does; how many."""
        events = self.manager.take_events()
        if events:
            assert self.pub is not None
            self.pub.publish(KVEventBatch(ts=time.time(), events=events))
        return len(events)

    def take(self) -> wire.KVEventBatch:
        """This step's events as one batch, not published but through vLLM's encoding."""
        return to_wire(KVEventBatch(ts=time.time(), events=self.manager.take_events()))

    def held(
        self,
        tokens: Sequence[int],
        group: int = 0,
        salt: str | None = None,
        lora: str | None = None,
    ) -> int:
        """vLLM's own answer: how many leading whole blocks of the prompt group ``group``
        holds in its cache map."""
        req = self.request(tokens, salt, lora)
        size = self.specs[group].block_size
        step = size // self.hash_block_size
        pool = self.manager.block_pool.cached_block_hash_to_block
        n = 0
        for j in range(step, len(req.block_hashes) + 1, step):
            key = make_block_hash_with_group_id(req.block_hashes[j - 1], group)
            if pool.get_one_block(key) is None:
                break
            n += 1
        return n

    def close(self) -> None:
        if self.pub is not None:
            self.pub.shutdown()


def to_wire(batch: KVEventBatch) -> wire.KVEventBatch:
    """A vLLM batch as the proxy decodes it from what vLLM's publisher sends."""
    return wire.decode_batch(msgspec.msgpack.encode(batch))


def prompt(length: int, salt: int) -> list[int]:
    """Token ids that differ per ``salt`` from the first token."""
    return [(i * 37 + salt * 101) % 30_000 + 1 for i in range(length)]
