"""HTTP fronts of ``bench pd``: vLLM's Mooncake P/D proxy flow, and a tap before each P.

``python -m app.bench.core.front mooncake --prefill URL --decode URL --bootstrap URL
--engine-id ID --port-file F`` is the minimal equivalent of vLLM's example Mooncake proxy
(``examples/online_serving/disaggregated_serving/mooncake_connector``): each completion goes at
once to P (``max_tokens=1``, ``do_remote_decode``) and to D (``do_remote_prefill`` with P's
bootstrap address and engine id, one ``transfer_id`` for both); D's answer, streamed or not, is
the client's. Chat completions (``/v1/chat/completions``) take the same flow, each engine
rendering the messages itself.

``python -m app.bench.core.front tap --upstream URL --port-file F`` forwards everything to one
engine and notes, per POST, when it arrived and when the engine's answer was back
(``time.time()``) and which prompt it carried (``prompt_key``); ``GET /bench/taps`` lists them.
Both systems' P sit behind one, so "when did P get the prompt" and "when was P done" are
observed the same way for both, request by request.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import time
import uuid
import zlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from app.ports import write_port_file

_HOP = {"content-length", "transfer-encoding", "connection", "host"}


def prompt_key(prompt: object) -> str | None:
    """A short name for a prompt of token ids (its length and CRC-32), to pair what the tap saw
    with the client's request; None for anything else (text prompts are not paired)."""
    if not isinstance(prompt, list) or not all(isinstance(t, int) for t in prompt):
        return None
    return f"{len(prompt)}:{zlib.crc32(json.dumps(prompt).encode()):08x}"


def _body_prompt_key(body: bytes) -> str | None:
    try:
        return prompt_key(json.loads(body).get("prompt"))
    except (ValueError, AttributeError):
        return None


def _client() -> httpx.AsyncClient:
    # Idle connections go before the engine's keep-alive (5 s) can close one under a request.
    limits = httpx.Limits(max_connections=None, keepalive_expiry=2.0)
    return httpx.AsyncClient(timeout=None, limits=limits)


def mooncake_app(prefill: str, decode: str, bootstrap: str, engine_id: str) -> Starlette:
    """The proxy: P and D at the same time, D's answer relayed."""
    client = _client()
    background: set[asyncio.Task[None]] = set()

    async def to_prefill(path: str, body: dict[str, Any], transfer_id: str) -> None:
        body = {**body, "max_tokens": 1, "stream": False}
        body.pop("stream_options", None)
        body.pop("max_completion_tokens", None)
        body["kv_transfer_params"] = {"do_remote_decode": True, "transfer_id": transfer_id}
        r = await client.post(f"{prefill}{path}", json=body)
        await r.aclose()

    async def completions(request: Request) -> Response:
        # Chat completions take the same flow: each engine renders the messages itself.
        path = request.url.path
        body = await request.json()
        transfer_id = uuid.uuid4().hex
        task = asyncio.create_task(to_prefill(path, body, transfer_id))
        background.add(task)
        task.add_done_callback(background.discard)
        body["kv_transfer_params"] = {
            "do_remote_prefill": True,
            "remote_bootstrap_addr": bootstrap,
            "remote_engine_id": engine_id,
            "transfer_id": transfer_id,
        }
        req = client.build_request("POST", f"{decode}{path}", json=body)
        upstream = await client.send(req, stream=True)
        if not body.get("stream"):
            content = await upstream.aread()
            await upstream.aclose()
            return Response(content, upstream.status_code, media_type="application/json")

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in upstream.aiter_bytes():
                    yield chunk
            finally:
                await upstream.aclose()

        media = upstream.headers.get("content-type", "text/event-stream")
        return StreamingResponse(relay(), upstream.status_code, media_type=media)

    async def health(_: Request) -> Response:
        return JSONResponse({"status": "ok"})

    return Starlette(
        routes=[
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", completions, methods=["POST"]),
            Route("/health", health),
        ]
    )


def tap_app(upstream: str) -> Starlette:
    """Forward to ``upstream``; note each POST's arrival and the time its answer was back."""
    client = _client()
    taps: list[dict[str, Any]] = []

    async def forward(request: Request) -> Response:
        arrived = time.time()
        body = await request.body()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        r = await client.request(
            request.method, f"{upstream}{request.url.path}", content=body, headers=headers
        )
        if request.method == "POST":
            taps.append(
                {
                    "path": request.url.path,
                    "arrived": arrived,
                    "ended": time.time(),
                    "status": r.status_code,
                    "prompt_key": _body_prompt_key(body),
                }
            )
        out = {k: v for k, v in r.headers.items() if k.lower() not in _HOP | {"content-encoding"}}
        return Response(r.content, r.status_code, headers=out)

    async def records(_: Request) -> Response:
        return JSONResponse({"taps": taps})

    return Starlette(
        routes=[
            Route("/bench/taps", records),
            Route("/{path:path}", forward, methods=["GET", "POST"]),
        ]
    )


def serve(app: Starlette, port_file: Path) -> None:
    """Bind port 0, report it in ``port_file``, serve until terminated."""
    sock = socket.create_server(("127.0.0.1", 0), backlog=1024)
    write_port_file(port_file, {"port": int(sock.getsockname()[1])})
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
    server.run(sockets=[sock])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m app.bench.core.front")
    parser.add_argument("kind", choices=("mooncake", "tap"))
    parser.add_argument("--port-file", type=Path, required=True)
    parser.add_argument("--upstream", default="")
    parser.add_argument("--prefill", default="")
    parser.add_argument("--decode", default="")
    parser.add_argument("--bootstrap", default="")
    parser.add_argument("--engine-id", default="")
    a = parser.parse_args(argv)
    if a.kind == "tap":
        serve(tap_app(a.upstream), a.port_file)
    else:
        serve(mooncake_app(a.prefill, a.decode, a.bootstrap, a.engine_id), a.port_file)


if __name__ == "__main__":
    main()
