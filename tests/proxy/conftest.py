"""Real HTTP servers for the proxy tests: the proxy, and fake vLLM prefill/decode instances.

Every server is uvicorn in a thread on its own pre-bound loopback port. The fake decode does
what the real connector does: on ``do_remote_prefill`` it posts its target to ``router_url``,
then waits until the fake prefill has received the prompt before it answers. Both fakes send
the transfer's token back in its header, as the connectors do.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client.parser import text_string_to_metric_families

from app.proxy import Flow, ProxyConfig, create_proxy
from app.proxy.bodies import TRANSFER_TOKEN_HEADER, TRANSFER_TOKEN_PARAM
from app.proxy.config import DecodeSidecar, parse_decode_sidecar
from tests.conftest import wait_for as shared_wait_for

TARGET_BLOCKS = [[3, 4, 5], [9]]
TOKEN_BASE = 5000  # the fake streams' token ids: TOKEN_BASE + position
# start_proxy's settings for a test of what a failure does without the retry (retries.py).
NO_RETRIES = {"retry_budget_ratio": 0.0, "retry_budget_min": 0}
# Scraped samples by name and labels.
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def wait_for(what: str, fn: Callable[[], Any], timeout_s: float = 5.0) -> Any:
    """The shared poll, with the proxy tests' short deadline and fine interval."""
    return shared_wait_for(what, fn, timeout_s, interval_s=0.02)


class ServerThread:
    """uvicorn serving ``app`` in a daemon thread on an already bound loopback socket."""

    def __init__(self, app: FastAPI, sock: socket.socket) -> None:
        self.sock = sock
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        config = uvicorn.Config(
            app, log_level="warning", lifespan="on", timeout_graceful_shutdown=1
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [sock]}, daemon=True
        )

    def start(self) -> ServerThread:
        self.thread.start()
        wait_for(f"{self.url} to start", lambda: self.server.started or not self.thread.is_alive())
        assert self.server.started, f"{self.url} failed to start"
        return self

    def signal_stop(self) -> None:
        self.server.should_exit = True

    def stop(self) -> None:
        self.signal_stop()
        self.thread.join(5)
        self.sock.close()


def bound_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


@dataclass
class Behaviour:
    """What a fake instance does; tests change it before (or between) requests."""

    health_status: int = 200
    status: int = 200  # answer to completions requests
    post_target: bool = True  # decode: post a target when asked for a remote prefill
    post_delay_s: float = 0.0  # decode: wait this long before posting it
    target_error: str | None = None  # decode: post this error instead of a target
    prefill_wait_s: float = 5.0  # decode: longest wait for prefill to receive the prompt
    delay_s: float = 0.0  # before answering (watching for the client going away)
    hold: threading.Event | None = None  # before answering, wait for this
    chunks: int = 4
    chunk_delay_s: float = 0.0
    kv_load: str | None = None  # decode: reported in the final answer's kv_transfer_params
    kv_load_error: str | None = None  # decode: and beside it, why it failed
    kv_send: str | None = None  # prefill: likewise ("failed": its sidecar was gone)
    # Prefill: whether its KV reaches decode (False: it dies mid-prefill, nothing comes).
    delivers: bool = True
    # Streams: break the connection after this many events (0: before the first), as a
    # killed engine does.
    break_after: int | None = None
    # Streams asked for return_token_ids carry them, as vLLM's do (test_stream_migration.py):
    # the token at position k of prompt + answer is TOKEN_BASE + k, so a stream stitched from
    # two decodes is contiguous exactly when no token is repeated or missing.
    token_ids: bool = False
    error_after: int | None = None  # with token_ids: an error event (code 500) after N events


def token_headers(kv: dict[str, Any]) -> dict[str, str]:
    """The header a connector sends on /v1/kv_targets: the token the proxy gave it."""
    token = kv.get(TRANSFER_TOKEN_PARAM)
    return {} if token is None else {TRANSFER_TOKEN_HEADER: token}


@dataclass
class Seen:
    path: str
    body: dict[str, Any]
    headers: dict[str, str]
    at: float = field(default_factory=time.monotonic)


@dataclass
class Shared:
    """State the fakes share: which transfer ids prefill received, and who served in order."""

    prefill_seen: dict[str, threading.Event] = field(default_factory=dict)
    order: list[str] = field(default_factory=list)
    aborted: dict[str, float] = field(default_factory=dict)  # by decode's sidecar: when
    lock: threading.Lock = field(default_factory=threading.Lock)

    def seen(self, tid: str) -> threading.Event:
        with self.lock:
            return self.prefill_seen.setdefault(tid, threading.Event())


class FakeVLLM:
    """A vLLM OpenAI server's outside: /health, /v1/models, (chat) completions, SSE streams."""

    def __init__(self, role: str, name: str, shared: Shared) -> None:
        self.role, self.name, self.shared = role, name, shared
        self.behaviour = Behaviour()
        self.requests: list[Seen] = []
        self.posts: list[tuple[dict[str, Any], int, dict[str, Any]]] = []  # body, status, answer
        self.answers: list[bytes] = []  # exact bytes of each answer (streams: joined)
        # Decode: whether prefill had the prompt before we answered, by transfer id.
        self.prefill_first: dict[str, bool] = {}
        # Prefill, concurrent flow: what fetching the target answered (status, body), by id.
        self.fetched: dict[str, tuple[int, dict[str, Any]]] = {}
        self._fetches: set[asyncio.Task[None]] = set()
        self.posted_at: dict[str, float] = {}  # decode: when it posted each target
        self.disconnected = threading.Event()
        self.app = self._build()
        self.server: ServerThread | None = None
        self._client: httpx.AsyncClient | None = None  # made on the server's own loop

    @property
    def url(self) -> str:
        assert self.server is not None
        return self.server.url

    def start(self) -> FakeVLLM:
        self.server = ServerThread(self.app, bound_socket()).start()
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()

    def _build(self) -> FastAPI:
        app = FastAPI()

        @app.get("/health")
        async def health() -> Response:
            return Response(status_code=self.behaviour.health_status)

        @app.get("/v1/models")
        async def models() -> JSONResponse:
            return JSONResponse({"object": "list", "data": [{"id": "tiny", "owned_by": self.name}]})

        @app.post("/v1/completions")
        async def completions(request: Request) -> Response:
            return await self._complete(request, "/v1/completions")

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> Response:
            return await self._complete(request, "/v1/chat/completions")

        return app

    async def _complete(self, request: Request, path: str) -> Response:
        body = await request.json()
        self.requests.append(Seen(path, body, dict(request.headers)))
        with self.shared.lock:
            self.shared.order.append(self.name)
        b = self.behaviour
        kv = body.get("kv_transfer_params") or {}
        if kv.get("router_url") and kv.get("do_remote_decode"):
            # Concurrent: fetch the target as the connector does, without holding the answer;
            # decode (which really waits for the KV) waits for the fetch.
            self._fetches.add(asyncio.create_task(self._fetch_target(kv)))
        elif kv.get("do_remote_decode") and b.delivers:
            self.shared.seen(kv["transfer_id"]).set()
        if kv.get("do_remote_prefill") and b.post_target:
            await self._post_target(kv)
        if b.hold is not None:
            await asyncio.to_thread(b.hold.wait, 10)
        if b.delay_s and await self._gone_within(request, b.delay_s):
            return Response(status_code=499)
        if b.status != 200:
            return self._answer({"error": {"message": f"{self.name} says no", "code": b.status}})
        if body.get("stream"):
            stream = (
                self._token_stream(body, path)
                if b.token_ids and body.get("return_token_ids")
                else self._stream(body)
            )
            return StreamingResponse(stream, media_type="text/event-stream")
        return self._answer(self._completion(body, 0, final=True))

    async def _post_target(self, kv: dict[str, Any]) -> None:
        b, tid = self.behaviour, kv["transfer_id"]
        await asyncio.sleep(b.post_delay_s)
        target = {
            "request_id": f"{self.name}-{tid}",
            "host": "127.0.0.1",
            "port": 4242,
            "engine_id": self.name,
            "epoch": 7,
            "tp_size": 1,
            "block_ids": TARGET_BLOCKS,
        }
        payload = (
            {"transfer_id": tid, "error": b.target_error}
            if b.target_error
            else {"transfer_id": tid, "target": target}
        )
        if self._client is None:
            self._client = httpx.AsyncClient(trust_env=False)
        self.posted_at[tid] = time.monotonic()
        r = await self._client.post(
            kv["router_url"], json=payload, headers=token_headers(kv), timeout=5
        )
        self.posts.append((payload, r.status_code, r.json()))
        if r.status_code == 200 and "target" in payload:
            seen = await asyncio.to_thread(self.shared.seen(tid).wait, b.prefill_wait_s)
            # Woken by an abort at decode's sidecar: no KV came, decode recomputes now.
            self.prefill_first[tid] = seen and tid not in self.shared.aborted

    async def _fetch_target(self, kv: dict[str, Any]) -> None:
        if self._client is None:
            self._client = httpx.AsyncClient(trust_env=False)
        tid = kv["transfer_id"]
        try:
            r = await self._client.get(
                f"{kv['router_url']}/{tid}",
                params={"timeout_s": kv["target_timeout_s"]},
                headers=token_headers(kv),
                timeout=10,
            )
            self.fetched[tid] = (r.status_code, r.json())
        finally:
            if self.behaviour.delivers:
                self.shared.seen(tid).set()

    async def _gone_within(self, request: Request, seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if await request.is_disconnected():
                self.disconnected.set()
                return True
            await asyncio.sleep(0.02)
        return False

    def _answer(self, payload: dict[str, Any]) -> Response:
        raw = json.dumps(payload).encode()
        self.answers.append(raw)
        return Response(raw, status_code=self.behaviour.status, media_type="application/json")

    def _completion(self, body: dict[str, Any], index: int, final: bool) -> dict[str, Any]:
        kv = body.get("kv_transfer_params") or {}
        # vLLM answers with kv_transfer_params too; the proxy must pass them through.
        answer_kv: dict[str, Any] = {"echo": kv.get("transfer_id")}
        if kv.get("transfer_id") in self.shared.aborted:
            answer_kv["kv_load"] = "failed"
        elif self.behaviour.kv_load is not None:
            answer_kv["kv_load"] = self.behaviour.kv_load
        if self.behaviour.kv_load_error is not None:
            answer_kv["kv_load_error"] = self.behaviour.kv_load_error
        if self.behaviour.kv_send is not None:
            answer_kv.update(kv_send=self.behaviour.kv_send, kv_send_error=f"{self.name}: gone")
        return {
            "id": f"cmpl-{self.name}",
            "object": "text_completion",
            "model": body.get("model", "tiny"),
            "served_by": self.name,
            "choices": [{"index": 0, "text": f"tok{index}", "finish_reason": None}],
            "kv_transfer_params": answer_kv if final else None,
        }

    async def _token_stream(self, body: dict[str, Any], path: str) -> AsyncIterator[bytes]:
        b, sent, done = self.behaviour, bytearray(), False
        try:
            for i, event in enumerate(_token_events(body, path, b.chunks)):
                if i == b.break_after:
                    raise ConnectionResetError(f"{self.name} died after {i} events")
                if i == b.error_after:
                    event = {"error": {"message": f"{self.name}: engine dead", "code": 500}}
                raw = f"data: {json.dumps(event)}\n\n".encode()
                sent += raw
                yield raw
                if i == b.error_after:
                    return
                await asyncio.sleep(b.chunk_delay_s)
            sent += b"data: [DONE]\n\n"
            yield b"data: [DONE]\n\n"
            done = True
        finally:
            self.answers.append(bytes(sent))
            if not done:
                self.disconnected.set()

    async def _stream(self, body: dict[str, Any]) -> AsyncIterator[bytes]:
        b, sent, done = self.behaviour, bytearray(), False
        try:
            for i in range(b.chunks):
                if i == b.break_after:
                    raise ConnectionResetError(f"{self.name} died after {i} events")
                event = f"data: {json.dumps(self._completion(body, i, i == b.chunks - 1))}\n\n"
                sent += event.encode()
                yield event.encode()
                await asyncio.sleep(b.chunk_delay_s)
            sent += b"data: [DONE]\n\n"
            yield b"data: [DONE]\n\n"
            done = True
        finally:
            self.answers.append(bytes(sent))
            if not done:
                self.disconnected.set()  # cancelled: the proxy closed our connection


def _fake_prompt_ids(body: dict[str, Any]) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return list(prompt)
    ids = (body.get("kv_transfer_params") or {}).get("prompt_token_ids")
    return list(ids) if ids else [1, 2, 3]


def _token_events(body: dict[str, Any], path: str, chunks: int) -> list[dict[str, Any]]:
    """vLLM's stream events with return_token_ids (one token each), chat- or completions-shaped,
    and the usage event when asked."""
    prompt, chat = _fake_prompt_ids(body), "chat" in path
    limit = body.get("max_tokens")
    n = chunks if limit is None else min(chunks, limit)
    head = {"id": f"fake-{len(prompt)}", "created": len(prompt), "model": body.get("model")}
    events: list[dict[str, Any]] = []
    if chat:
        role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
        events.append(
            {
                **head,
                "object": "chat.completion.chunk",
                "choices": [role],
                "prompt_token_ids": prompt,
            }
        )
    for i in range(n):
        tid = TOKEN_BASE + len(prompt) + i
        last = i == n - 1
        finish = ("length" if n == limit else "stop") if last else None
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "token_ids": [tid]}
        if chat:
            choice["delta"] = {"content": f" w{tid}"}
            events.append({**head, "object": "chat.completion.chunk", "choices": [choice]})
        else:
            choice["text"] = f" w{tid}"
            choice["prompt_token_ids"] = prompt if i == 0 else None
            events.append({**head, "object": "text_completion", "choices": [choice]})
    if (body.get("stream_options") or {}).get("include_usage"):
        usage = {
            "prompt_tokens": len(prompt),
            "completion_tokens": n,
            "total_tokens": len(prompt) + n,
        }
        kind = "chat.completion.chunk" if chat else "text_completion"
        events.append({**head, "object": kind, "choices": [], "usage": usage})
    return events


class FakeSidecar:
    """Decode's sidecar admin API, its abort only: a transfer decode posted a target for is
    aborted (decode's wait ends, and it answers ``kv_load: failed``); others are 404."""

    def __init__(self, decode: FakeVLLM, token: str | None = None) -> None:
        self.decode, self.token = decode, token
        self.aborts: list[Seen] = []
        app = FastAPI()

        @app.post("/v1/requests/{rid}/abort")
        async def abort(rid: str, request: Request) -> JSONResponse:
            self.aborts.append(Seen(request.url.path, await request.json(), dict(request.headers)))
            if self.token is not None and request.headers.get("authorization") != (
                f"Bearer {self.token}"
            ):
                return JSONResponse({"detail": "wrong token"}, status_code=401)
            if rid not in self.decode.posted_at:
                return JSONResponse({"detail": f"request {rid} is not known"}, status_code=404)
            shared = self.decode.shared
            shared.aborted[rid] = time.monotonic()
            shared.seen(rid).set()
            return JSONResponse({"id": rid, "aborted": [0], "entries": []})

        self.server = ServerThread(app, bound_socket()).start()

    @property
    def url(self) -> str:
        return self.server.url


@dataclass
class Cluster:
    prefill: list[FakeVLLM]
    decode: list[FakeVLLM]
    shared: Shared
    proxy: ServerThread | None = None
    sidecars: list[FakeSidecar] = field(default_factory=list)  # decode's, in its order
    # One client for the test's calls (a new one per call costs tens of ms for its TLS setup).
    client: httpx.Client = field(default_factory=lambda: httpx.Client(trust_env=False))

    @property
    def url(self) -> str:
        assert self.proxy is not None
        return self.proxy.url

    def start_proxy(
        self,
        prefill: tuple[str, ...] | None = None,
        decode: tuple[str, ...] | None = None,
        **cfg: Any,
    ) -> Cluster:
        """Start the proxy over the fakes (after the test set their health, if it needs), or
        over the instance URLs ``prefill`` / ``decode`` given (e.g. DP ranks of a fake)."""
        sock = bound_socket()
        config = ProxyConfig(
            prefill=prefill or tuple(f.url for f in self.prefill),
            decode=decode or tuple(f.url for f in self.decode),
            public_url=f"http://127.0.0.1:{sock.getsockname()[1]}",
            **{
                "target_timeout_s": 5.0,
                "request_timeout_s": 10.0,
                "health_interval_s": 30.0,
                # The flow most of these tests pin down; test_concurrent_flow.py the default.
                "flow": Flow.DECODE_FIRST,
                # Every request through prefill, whatever its size or history; test_disagg.py
                # turns the rules on.
                "min_prefill_tokens": 0,
                "decode_hit_fraction": 2.0,
            }
            | cfg,
        )
        self.proxy = ServerThread(create_proxy(config), sock).start()
        return self

    def with_decode_sidecars(self, token: str | None = None) -> tuple[DecodeSidecar, ...]:
        """Start a fake sidecar per decode; the proxy's ``decode_sidecars`` for them."""
        self.sidecars = [FakeSidecar(d, token) for d in self.decode]
        return tuple(
            parse_decode_sidecar(f"{d.url}={s.url}")
            for d, s in zip(self.decode, self.sidecars, strict=True)
        )

    def post(
        self, path: str = "/v1/completions", timeout: float = 10, **body: Any
    ) -> httpx.Response:
        """A request from a client: ``body`` plus the model name."""
        url, payload = f"{self.url}{path}", {"model": "tiny", **body}
        return self.client.post(url, json=payload, timeout=timeout)

    def get(self, path: str, headers: dict[str, str] | None = None) -> httpx.Response:
        return self.client.get(f"{self.url}{path}", headers=headers, timeout=5)

    def metrics(self) -> Samples:
        """The proxy's /metrics, parsed."""
        r = self.get("/metrics")
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
        return {
            (s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(r.text)
            for s in family.samples
        }

    def record(self, tid: str) -> dict[str, Any]:
        """The proxy's record of one transfer, once it is no longer pending."""

        def settled() -> dict[str, Any] | None:
            r = self.get(f"/v1/transfers/{tid}").json()
            return None if r["status"] == "pending" else r

        # 20 s, not the proxy tests' 5 s: a loaded CI host once took longer.
        return dict(wait_for(f"transfer {tid} to settle", settled, timeout_s=20.0))

    def stop(self) -> None:
        # Signalled together: each server takes up to 0.1 s to notice.
        servers = [f.server for f in (*self.prefill, *self.decode)] + [self.proxy]
        servers += [s.server for s in self.sidecars]
        live = [s for s in servers if s is not None]
        for s in live:
            s.signal_stop()
        for s in live:
            s.stop()
        self.client.close()


def sample(samples: Samples, name: str, **labels: str) -> float | None:
    """One sample's value (None: absent)."""
    return samples.get((name, frozenset(labels.items())))


@pytest.fixture
def make_cluster() -> Iterator[Callable[..., Cluster]]:
    """``make_cluster(n_prefill, n_decode)``: started fakes; the test starts the proxy."""
    made: list[Cluster] = []

    def make(n_prefill: int = 1, n_decode: int = 1) -> Cluster:
        shared = Shared()
        c = Cluster(
            prefill=[FakeVLLM("prefill", f"p{i}", shared).start() for i in range(n_prefill)],
            decode=[FakeVLLM("decode", f"d{i}", shared).start() for i in range(n_decode)],
            shared=shared,
        )
        made.append(c)
        return c

    yield make
    for c in made:
        c.stop()


@pytest.fixture
def cluster(make_cluster: Callable[..., Cluster]) -> Cluster:
    """One prefill, one decode, and the proxy over them."""
    return make_cluster().start_proxy()
