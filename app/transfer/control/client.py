"""``PeerClient``: the asyncio DEALER side of the control plane (framing, caps and
authentication in ``app.transfer.control``)."""

from __future__ import annotations

import asyncio

import zmq
import zmq.asyncio

from app.errors import AuthError, ConfigError, DeadlineExceeded, ProtocolError
from app.transfer.control.framing import (
    _NOTIFY_TIMEOUT_S,
    DEFAULT_MAX_FRAME_BYTES,
    ONE_WAY,
    ClientClosed,
    LogThrottle,
    corr_ids,
    log,
)
from app.transfer.wire.auth import MAX_SKEW_S, FrameAuth
from app.transfer.wire.codec import decode, describe, encode
from app.transfer.wire.protocol import AnyMsg, Error, Msg


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
