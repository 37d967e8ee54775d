"""``ControlServer``: the ROUTER side of the control plane (framing, caps and authentication
in ``app.transfer.control``)."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
from pathlib import Path
from typing import cast

import zmq
import zmq.asyncio

from app.errors import AuthError, ConfigError, ProtocolError
from app.transfer.control.framing import (
    _HARD_CAP_FACTOR,
    _LOG_INTERVAL_S,
    DEFAULT_ENGINE_FRAME_BYTES,
    DEFAULT_MAX_FRAME_BYTES,
    ONE_WAY,
    Handler,
    LogThrottle,
    log,
)
from app.transfer.wire.auth import UNAUTHENTICATED_REASON, FrameAuth
from app.transfer.wire.codec import decode, describe, encode
from app.transfer.wire.protocol import AnyMsg, Error, Msg

# Frames the receive loop reads before it gives the event loop a turn.
_FAIR_BATCH = 32


class ControlServer:
    """ROUTER that decodes each frame and answers through ``handler``, one task per message.

    ``auth`` seals and opens every frame (see the module's docstring); None serves unsealed
    frames, for the engines' local socket only.

    ``max_frame_bytes`` caps a payload (default: ``DEFAULT_MAX_FRAME_BYTES`` for a ``tcp://``
    endpoint, which peers reach, ``DEFAULT_ENGINE_FRAME_BYTES`` for the engines' ``ipc://``).

    At most ``max_inflight`` handlers run at once; past that the receive loop stops reading, so
    a flood backs up into ZMQ's bounded queues instead of this process's memory. Messages of an
    ``inline`` type are answered in the receive loop itself, without a task: their handler must
    never wait. An engine polls ``GetFinished`` every step, and the task per poll cost the
    sidecar a core's worth of CPU that the transfers on a small host need.

    The socket is a plain (not ``zmq.asyncio``) ROUTER read without blocking when the loop
    sees its descriptor readable: pyzmq's asyncio wrapper builds futures and re-arms its
    handlers on every receive and send, about half of a poll's round trip in this process.
    A ROUTER's send never blocks (a peer gone or over its HWM loses the reply), so replies are
    sent at once.
    """

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        endpoint: str,
        handler: Handler,
        *,
        name: str = "control",
        max_inflight: int = 256,
        inline: tuple[type[Msg], ...] = (),
        max_frame_bytes: int | None = None,
        log_interval_s: float = _LOG_INTERVAL_S,
        auth: FrameAuth | None = None,
    ) -> None:
        if max_inflight < 1:
            raise ConfigError(f"{name}: max_inflight must be >= 1, got {max_inflight}")
        if max_frame_bytes is None:
            tcp = endpoint.startswith("tcp://")
            max_frame_bytes = DEFAULT_MAX_FRAME_BYTES if tcp else DEFAULT_ENGINE_FRAME_BYTES
        if max_frame_bytes < 1:
            raise ConfigError(f"{name}: max_frame_bytes must be >= 1, got {max_frame_bytes}")
        self.max_frame_bytes = max_frame_bytes
        self._ctx = ctx
        self._endpoint = endpoint
        self._handler = handler
        self._inline = inline
        self._auth = auth
        self.name = name
        self._sem = asyncio.Semaphore(max_inflight)
        self._sock: zmq.Socket[bytes] | None = None
        self._fd: int | None = None
        self._readable: asyncio.Future[None] | None = None
        self._loop_task: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._throttle = LogThrottle(log_interval_s)
        self.endpoint: str | None = None
        self.frames = 0
        self.replies = 0
        self.rejected = 0
        self.unauthenticated_frames = 0
        self.handler_errors = 0

    def counters(self) -> dict[str, int]:
        return {
            "frames": self.frames,
            "replies": self.replies,
            "rejected": self.rejected,
            "unauthenticated_frames": self.unauthenticated_frames,
            "handler_errors": self.handler_errors,
        }

    @property
    def port(self) -> int | None:
        """The bound TCP port (the real one after binding port 0); None for IPC or before start."""
        if self.endpoint is None or not self.endpoint.startswith("tcp://"):
            return None
        return int(self.endpoint.rsplit(":", 1)[1])

    async def start(self) -> str:
        """Bind and start serving; returns the actual endpoint (ephemeral port resolved)."""
        if self._sock is not None:
            raise RuntimeError(f"{self.name}: already started on {self.endpoint}")
        if self._endpoint.startswith("ipc://"):
            _ipc_prepare(self._endpoint)
        # A plain socket on the asyncio context's I/O threads (see the class docstring).
        sock: zmq.Socket[bytes] = zmq.Context.shadow(self._ctx.underlying).socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self.max_frame_bytes * _HARD_CAP_FACTOR)
        try:
            sock.bind(self._endpoint)
        except zmq.ZMQError as e:
            sock.close(linger=0)
            raise ConfigError(f"{self.name}: cannot bind {self._endpoint}: {e}") from None
        # LAST_ENDPOINT carries the port the OS chose for "tcp://host:0" or "tcp://host:*".
        self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._sock = sock
        loop = asyncio.get_running_loop()
        fd = self._fd = cast(int, sock.getsockopt(zmq.FD))
        loop.add_reader(fd, self._wake)
        self._loop_task = loop.create_task(self._serve(sock), name=f"{self.name}-recv")
        log.info("%s: serving on %s", self.name, self.endpoint)
        if self._auth is None and _exposed(self.endpoint):
            log.warning(
                "%s: %s serves without frame authentication: anyone who reaches it can send "
                "control messages",
                self.name,
                self.endpoint,
            )
        return self.endpoint

    async def stop(self) -> None:
        """Stop reading, cancel running handlers (no replies for them), close the socket."""
        tasks = [t for t in (self._loop_task, *self._tasks) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._loop_task = None
        if self._fd is not None:
            asyncio.get_running_loop().remove_reader(self._fd)
            self._fd = None
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    def _wake(self) -> None:
        """The socket's descriptor is readable: let the receive loop look. While it is not
        waiting (a handler runs, or ``max_inflight`` handlers do), reading ``EVENTS`` clears
        the descriptor, or the loop would call this again on every turn; the receive loop
        tries a receive before it waits, so nothing is missed."""
        if self._readable is not None:
            if not self._readable.done():
                self._readable.set_result(None)
        elif self._sock is not None:
            _pending(self._sock)

    async def _recv(self, sock: zmq.Socket[bytes]) -> list[bytes]:
        """The next message, waiting on the descriptor while there is none.

        ZMQ's descriptor signals edges, not levels, and any call on the socket (a send too) may
        consume one: so ``EVENTS`` is read after every miss, before waiting, which re-arms it.
        """
        while True:
            try:
                return sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                pass
            if _pending(sock):
                continue
            self._readable = asyncio.get_running_loop().create_future()
            try:
                await self._readable
            finally:
                self._readable = None

    async def _serve(self, sock: zmq.Socket[bytes]) -> None:
        while True:
            if self.frames % _FAIR_BATCH == _FAIR_BATCH - 1:
                # Frames that wait are read without yielding: a flood would hold the loop the
                # transfers, the admin API and same-process clients share.
                await asyncio.sleep(0)
            try:
                frames = await self._recv(sock)
            except zmq.ZMQError as e:  # socket or context closed under us: nothing left to serve
                log.error("%s: receive loop stopped: %s", self.name, e)
                return
            self.frames += 1
            rejected = self.rejected
            try:
                await self._dispatch(sock, frames)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                # Whatever one frame does, the loop keeps serving the others, and the frame is
                # still counted and answered like any other rejection.
                if self.rejected == rejected:
                    self.rejected += 1
                self._throttle.log(
                    "internal",
                    "%s: unexpected error handling a frame from %r: %r",
                    self.name,
                    frames[0],
                    e,
                    exc_info=True,
                )
                corr = frames[1] if len(frames) == 3 and len(frames[1]) == 8 else b""
                if corr != ONE_WAY:
                    with contextlib.suppress(Exception):
                        reason = f"{self.name}: internal error on this frame: {e!r}"[:300]
                        # Unsealed: the frame may not have been authenticated.
                        await self._send(sock, frames[0], corr, Error(reason=reason), sealed=False)

    async def _dispatch(self, sock: zmq.Socket[bytes], frames: list[bytes]) -> None:
        identity = frames[0]
        if len(frames) != 3 or len(frames[1]) != 8:
            corr = frames[1] if len(frames) >= 3 and len(frames[1]) == 8 else b""
            reason = (
                f"expected frames [corr_id(8 bytes), payload], got {len(frames) - 1} frame(s) "
                f"of {[len(f) for f in frames[1:5]]} bytes"
            )
            await self._reject(sock, identity, corr, reason, "framing")
            return
        corr, payload = frames[1], frames[2]
        if len(payload) > self.max_frame_bytes:
            reason = (
                f"frame too large: expected at most {self.max_frame_bytes} bytes, got "
                f"{describe(payload)}"
            )
            await self._reject(sock, identity, corr, reason, "oversized")
            return
        if self._auth is not None:
            try:
                payload = self._auth.open(payload)
            except AuthError as e:
                self.unauthenticated_frames += 1
                # The sender learns only the fixed reason; the log has what failed.
                await self._reject(
                    sock, identity, corr, UNAUTHENTICATED_REASON, "unauthenticated", detail=str(e)
                )
                return
        try:
            msg = decode(payload)
        except ProtocolError as e:
            # Authenticated (or no auth): a key holder speaking another protocol version.
            await self._reject(sock, identity, corr, str(e), "malformed", sealed=True)
            return
        if isinstance(msg, self._inline):
            await self._handle(sock, identity, corr, msg)
            return
        await self._sem.acquire()
        task = asyncio.get_running_loop().create_task(
            self._handle(sock, identity, corr, msg), name=f"{self.name}-{type(msg).__name__}"
        )
        self._tasks.add(task)
        # A callback, not a finally: a task cancelled before its first step never runs its body.
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        self._sem.release()

    async def _reject(
        self,
        sock: zmq.Socket[bytes],
        identity: bytes,
        corr: bytes,
        reason: str,
        kind: str,
        *,
        sealed: bool = False,
        detail: str | None = None,
    ) -> None:
        """Count, log (``detail`` if given, else ``reason``) and answer ``Error(reason)``."""
        self.rejected += 1
        self._throttle.log(
            kind, "%s: rejected a frame from %r: %s", self.name, identity, detail or reason
        )
        if corr != ONE_WAY:
            await self._send(sock, identity, corr, Error(reason=reason), sealed=sealed)

    async def _handle(
        self, sock: zmq.Socket[bytes], identity: bytes, corr: bytes, msg: AnyMsg
    ) -> None:
        kind = type(msg).__name__
        reply: Msg | None
        try:
            reply = await self._handler(msg, identity)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.handler_errors += 1
            # A peer can make a handler fail at will (an unknown request id): throttled too.
            self._throttle.log(
                "handler", "%s: handler failed on %s from %r: %r", self.name, kind, identity, exc
            )
            reply = Error(reason=str(exc) or type(exc).__name__)
        if corr == ONE_WAY:
            return
        if reply is None:
            self.handler_errors += 1
            self._throttle.log(
                "handler", "%s: handler returned no reply to request %s", self.name, kind
            )
            reply = Error(reason=f"{self.name}: no reply to {kind}")
        await self._send(sock, identity, corr, reply)

    async def _send(
        self,
        sock: zmq.Socket[bytes],
        identity: bytes,
        corr: bytes,
        reply: Msg,
        *,
        sealed: bool = True,
    ) -> None:
        """Send ``reply``, sealed when this server has auth and ``sealed`` (the request was
        authenticated)."""
        try:
            payload = encode(reply)
        except Exception as e:  # a handler returned something that is not a wire message
            self.handler_errors += 1
            payload = encode(Error(reason=f"{self.name}: reply does not encode: {e}"))
        if sealed and self._auth is not None:
            payload = self._auth.seal(payload)
        # ROUTER never blocks on send: a peer that left or is over its HWM just loses the reply.
        try:
            sock.send_multipart([identity, corr, payload], zmq.NOBLOCK)
            self.replies += 1
        except zmq.Again:
            pass
        # The send may have consumed the descriptor's edge of a message that came meanwhile.
        if self._readable is not None and _pending(sock):
            self._wake()


def _pending(sock: zmq.Socket[bytes]) -> bool:
    """A message waits to be received (reading ``EVENTS`` also re-arms the descriptor)."""
    return bool(cast(int, sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN)


def _ipc_prepare(endpoint: str) -> None:
    path = endpoint.removeprefix("ipc://")
    if path.startswith("@"):  # Linux abstract namespace: no file
        return
    if len(path.encode()) > zmq.IPC_PATH_MAX_LEN:
        raise ConfigError(
            f"IPC path {path!r} is longer than the {zmq.IPC_PATH_MAX_LEN} bytes a Unix socket "
            "allows; choose a shorter directory"
        )
    Path(path).parent.mkdir(parents=True, exist_ok=True)


def _exposed(endpoint: str) -> bool:
    """A ``tcp://`` endpoint bound to more than loopback: other hosts may reach it."""
    if not endpoint.startswith("tcp://"):
        return False
    host = endpoint.removeprefix("tcp://").rsplit(":", 1)[0].strip("[]")
    try:
        return not ipaddress.ip_address(host).is_loopback
    except ValueError:
        return True
