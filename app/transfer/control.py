"""ZMQ request/response plane (DESIGN §4): sidecar <-> sidecar and engine <-> sidecar.

One ``ControlServer`` (a ROUTER) serves the peer control port (``tcp://``) and another the
engines' socket (``ipc://``). ``PeerClient`` (asyncio DEALER) talks to a remote sidecar;
``SyncClient`` (blocking DEALER, in ``sync_client``) is for engine workers, which are
synchronous code.

Framing, fixed:

- A client sends two frames ``[corr_id, payload]``: ``corr_id`` is 8 bytes (a big-endian
  per-client counter starting at 1) and ``payload`` is ``protocol.encode(msg)``.
- The server's ROUTER sees ``[identity, corr_id, payload]`` and answers
  ``[identity, corr_id, reply_payload]``; the client's DEALER sees ``[corr_id, reply_payload]``.
- ``corr_id`` of 8 zero bytes (``ONE_WAY``) marks a one-way message: the server never answers
  it, whatever the handler returns, even when it is malformed or the handler raises (those are
  counted and logged). Engines send their high-rate ``LayerReady`` this way.
- A frame that does not fit (wrong frame count, ``corr_id`` not 8 bytes, a payload over
  ``max_frame_bytes``, a payload that does not decode or breaks a field's bounds, an unknown
  version) is counted in ``rejected`` and answered with ``Error(reason)`` under the sender's
  ``corr_id`` when it has one, else under an empty ``corr_id`` frame (which a ``PeerClient``
  drops as unknown and a raw socket can still read). A frame part over ``_HARD_CAP_FACTOR``
  times the cap never reaches this process: ZMQ drops the connection that sent it (uncounted;
  the sender's DEALER reconnects, and that request ends at its deadline).
- Log lines about bad frames, failing handlers and bad replies are throttled per kind of problem
  (one line per ``_LOG_INTERVAL_S``, saying how many were held back): a peer that floods bad
  frames must not flood the log too.
- A handler that raises is answered with ``Error(reason=str(exc))``; a handler that returns
  ``None`` to a request (not one-way) is answered with ``Error`` too, so the caller fails now
  instead of at its deadline.

Authentication (``auth``, a :class:`~app.transfer.auth.FrameAuth`; the peer port has one, the
engines' same-pod ``ipc://`` socket does not): every ``payload`` is sealed (an HMAC header in
front of ``protocol.encode(msg)``). The server opens each frame after the size cap (which applies
to the sealed frame) and before decoding; a frame that fails is counted in ``rejected`` and
``unauthenticated_frames``, never reaches the handler, and is answered with the fixed
``UNAUTHENTICATED_REASON``. Replies to authenticated frames are sealed; replies to any frame that
was not authenticated (bad framing, over the cap, failing auth) are not: their text may echo the
sender's bytes, and sealing it would hand a forger a sealed message of its choosing. A client
with ``auth`` fails a request whose reply does not open, like any bad reply, and quotes an
unsealed ``Error`` in its exception as unverified so that a key mismatch can be diagnosed.

Replies are matched by ``corr_id`` only, so one client may have many requests in flight; a reply
that comes after its request's deadline is dropped and counted. A reply that is over the cap or
does not decode fails only the request it answers (or is dropped when it answers none); the
client stays usable for every later request. A request sent while the peer is down waits in the
DEALER's queue (no ``IMMEDIATE``) and goes out when the peer comes up, even if its deadline has
passed by then; the late reply is dropped like any other.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import itertools
import logging
import struct
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import zmq
import zmq.asyncio

from app.errors import AuthError, ConfigError, DeadlineExceeded, KVSidecarError, ProtocolError
from app.transfer.auth import MAX_SKEW_S, UNAUTHENTICATED_REASON, FrameAuth
from app.transfer.protocol import AnyMsg, Error, Msg, decode, describe, encode

__all__ = [
    "DEFAULT_ENGINE_FRAME_BYTES",
    "DEFAULT_MAX_FRAME_BYTES",
    "ONE_WAY",
    "ClientClosed",
    "ControlServer",
    "Handler",
    "LogThrottle",
    "PeerClient",
]

log = logging.getLogger(__name__)

Handler = Callable[[AnyMsg, bytes], Awaitable[Msg | None]]
"""``(message, peer identity) -> reply``; ``None`` means no reply (one-way messages)."""

ONE_WAY = b"\x00" * 8
_CORR = struct.Struct(">Q")
# A stuck peer should not hold an async notify forever, but a busy one gets a while to drain.
_NOTIFY_TIMEOUT_S = 5.0
# Engines must not stall the forward pass for long on a sidecar that stopped reading.
# Peers send handshakes, Done and Abort: kilobytes. A frame far past that is an attack or a bug,
# and decoding it would hold the event loop (an 8 MiB frame stalled /livez for seconds).
DEFAULT_MAX_FRAME_BYTES = 1 << 20
# Engines are local and send token id lists of whole prompts (PoolSave of a 1M-token prompt is
# about 5 MiB), so their socket gets more room.
DEFAULT_ENGINE_FRAME_BYTES = 64 << 20
# Parts up to this multiple of the cap are read and answered with Error, so an honest sender
# learns why; past it ZMQ drops the connection before the bytes are buffered in this process.
_HARD_CAP_FACTOR = 4
_LOG_INTERVAL_S = 5.0


class ClientClosed(KVSidecarError):
    """The client was closed while a request was waiting for its reply."""


class LogThrottle:
    """At most one log line per ``interval`` seconds per kind; says how many were held back.

    Kinds are a few fixed words chosen by the code, never the peer's identity or the reason text:
    both are the sender's to vary, and one key per value would let it flood the log again.
    """

    def __init__(self, interval: float = _LOG_INTERVAL_S) -> None:
        self._interval = interval
        self._next: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def allow(self, kind: str = "") -> int | None:
        """Number of lines of ``kind`` held back since the last one allowed, or None to stay
        quiet."""
        now = time.monotonic()
        if now < self._next.get(kind, 0.0):
            self._suppressed[kind] = self._suppressed.get(kind, 0) + 1
            return None
        self._next[kind] = now + self._interval
        return self._suppressed.pop(kind, 0)

    def log(self, kind: str, msg: str, *args: object, exc_info: bool = False) -> None:
        """``log.warning`` unless ``kind`` was logged within the interval."""
        held = self.allow(kind)
        if held is None:
            return
        if held:
            msg += " (%d more like it in the last %gs not logged)"
            args = (*args, held, self._interval)
        log.warning(msg, *args, exc_info=exc_info, stacklevel=2)


def corr_ids() -> Callable[[], bytes]:
    counter = itertools.count(1)  # 0 is ONE_WAY
    return lambda: _CORR.pack(next(counter))


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
        self._sock: zmq.asyncio.Socket | None = None
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
        sock = self._ctx.socket(zmq.ROUTER)
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
        self._loop_task = asyncio.get_running_loop().create_task(
            self._serve(sock), name=f"{self.name}-recv"
        )
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
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    async def _serve(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            try:
                frames = await sock.recv_multipart()
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

    async def _dispatch(self, sock: zmq.asyncio.Socket, frames: list[bytes]) -> None:
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
        sock: zmq.asyncio.Socket,
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
        self, sock: zmq.asyncio.Socket, identity: bytes, corr: bytes, msg: AnyMsg
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
        sock: zmq.asyncio.Socket,
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
        await sock.send_multipart([identity, corr, payload])
        self.replies += 1


class PeerClient:
    """Asyncio DEALER to one endpoint; many requests may be in flight. Event loop only.

    With ``auth`` every request is sealed and every reply must open (same key as the server).
    """

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        endpoint: str,
        *,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        auth: FrameAuth | None = None,
    ) -> None:
        if max_frame_bytes < 1:
            raise ConfigError(f"{endpoint}: max_frame_bytes must be >= 1, got {max_frame_bytes}")
        self.endpoint = endpoint
        self.max_frame_bytes = max_frame_bytes
        self._auth = auth
        self._sock: zmq.asyncio.Socket = ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        # No MAXMSGSIZE here: a DEALER that hits it drops its connection and (libzmq 4.3.5, as
        # tested) does not come back, which would break the client for good. Replies over the
        # cap are refused after receipt instead.
        self._sock.connect(endpoint)
        self._throttle = LogThrottle()
        self._next_corr = corr_ids()
        self._pending: dict[bytes, asyncio.Future[AnyMsg]] = {}
        self._reader: asyncio.Task[None] | None = None
        self._closed = False
        self.requests = 0
        self.notifies = 0
        self.replies = 0
        self.dropped = 0
        self.malformed = 0
        self.unauthenticated = 0

    def counters(self) -> dict[str, int]:
        return {
            "requests": self.requests,
            "notifies": self.notifies,
            "replies": self.replies,
            "dropped": self.dropped,
            "malformed": self.malformed,
            "unauthenticated": self.unauthenticated,
        }

    async def request(self, msg: Msg, timeout: float) -> AnyMsg:
        """Send ``msg`` and wait for its reply; ``Error`` replies are returned, not raised."""
        self._check_open()
        # A reader that stopped (its socket errored) is started again: one bad moment must not
        # leave every later request to wait out its deadline.
        if self._reader is None or self._reader.done():
            self._reader = asyncio.get_running_loop().create_task(
                self._read(), name=f"peer-reader-{self.endpoint}"
            )
        corr = self._next_corr()
        fut: asyncio.Future[AnyMsg] = asyncio.get_running_loop().create_future()
        self._pending[corr] = fut
        self.requests += 1
        try:
            # The send is inside the deadline too: it waits while the queue to the peer is full.
            async with asyncio.timeout(timeout):
                await self._sock.send_multipart([corr, self._payload(msg)])
                return await fut
        except TimeoutError:
            raise DeadlineExceeded(
                f"no reply from {self.endpoint} to {type(msg).__name__} within {timeout}s"
            ) from None
        finally:
            self._pending.pop(corr, None)

    async def notify(self, msg: Msg, *, timeout: float = _NOTIFY_TIMEOUT_S) -> None:
        """Send ``msg`` one-way; waits only while the queue to the peer is full."""
        self._check_open()
        try:
            async with asyncio.timeout(timeout):
                await self._sock.send_multipart([ONE_WAY, self._payload(msg)])
        except TimeoutError:
            raise DeadlineExceeded(
                f"could not queue {type(msg).__name__} to {self.endpoint} within {timeout}s"
            ) from None
        self.notifies += 1

    async def close(self) -> None:
        """Fail waiting requests with ``ClientClosed`` and close the socket."""
        if self._closed:
            return
        self._closed = True
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(ClientClosed(f"client to {self.endpoint} closed"))
        self._pending.clear()
        self._sock.close(linger=0)

    def _check_open(self) -> None:
        if self._closed:
            raise ClientClosed(f"client to {self.endpoint} is closed")

    def _payload(self, msg: Msg) -> bytes:
        # Sealed when the request is made, so time queued for a down peer counts against the
        # skew window: a request that waited past it is refused, as its deadline has passed.
        payload = encode(msg)
        return payload if self._auth is None else self._auth.seal(payload)

    async def _read(self) -> None:
        while True:
            try:
                frames = await self._sock.recv_multipart()
            except zmq.ZMQError as e:  # waiting requests still end at their deadlines
                log.error("reader for %s stopped: %s", self.endpoint, e)
                return
            try:
                self._on_reply(frames)
            except Exception as e:
                # Whatever one reply holds, the reader lives on for the next ones.
                self.malformed += 1
                self._throttle.log(
                    "internal",
                    "reply from %s broke the reader: %r",
                    self.endpoint,
                    e,
                    exc_info=True,
                )

    def _on_reply(self, frames: list[bytes]) -> None:
        if len(frames) != 2:
            self.malformed += 1
            self._throttle.log(
                "framing",
                "dropped a reply from %s: expected frames [corr_id(8 bytes), payload], got %s",
                self.endpoint,
                [len(f) for f in frames[:4]],
            )
            return
        corr, payload = frames
        fut = self._pending.get(corr)
        if fut is None or fut.done():
            self.dropped += 1  # late (past its deadline) or not ours
            return
        try:
            if len(payload) > self.max_frame_bytes:
                raise ProtocolError(
                    f"frame too large: expected at most {self.max_frame_bytes} bytes, got "
                    f"{describe(payload)}"
                )
            if self._auth is not None:
                payload = self._open(payload)
            msg = decode(payload)
        except AuthError as e:
            self.malformed += 1
            self.unauthenticated += 1
            self._throttle.log("unauthenticated", "bad reply from %s: %s", self.endpoint, e)
            fut.set_exception(e)
            return
        except Exception as e:  # decode raises only ProtocolError; anything else fails here too
            # Fails the one request this answers; the others and later ones are untouched.
            self.malformed += 1
            self._throttle.log("malformed", "bad reply from %s: %s", self.endpoint, e)
            fut.set_exception(ProtocolError(f"reply from {self.endpoint}: {e}"))
            return
        fut.set_result(msg)
        self.replies += 1

    def _open(self, payload: bytes) -> bytes:
        try:
            return self._auth.open(payload) if self._auth is not None else payload
        except AuthError as e:
            said = _unverified_reason(payload)
            raise AuthError(
                f"reply from {self.endpoint} is not authenticated ({e}). Likely cause: the peer "
                "has a different control-plane key or none, or the clocks differ by more than "
                f"{MAX_SKEW_S:g} s{said}"
            ) from None


def _unverified_reason(payload: bytes) -> str:
    """The text of an unsealed ``Error`` reply, marked as unverified; empty for anything else.

    A server answers a frame it could not authenticate unsealed, so this is where a key
    mismatch says so. Anyone on the path could have written it: it only goes into the error.
    """
    try:
        msg = decode(payload)
    except Exception:
        return ""
    if not isinstance(msg, Error):
        return ""
    return f". The peer answered (unverified): {msg.reason[:300]!r}"


def _exposed(endpoint: str) -> bool:
    """A ``tcp://`` endpoint bound to more than loopback: other hosts may reach it."""
    if not endpoint.startswith("tcp://"):
        return False
    host = endpoint.removeprefix("tcp://").rsplit(":", 1)[0].strip("[]")
    try:
        return not ipaddress.ip_address(host).is_loopback
    except ValueError:
        return True
