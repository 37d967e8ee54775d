"""The engine side of the engine link: a blocking DEALER for worker processes."""

from __future__ import annotations

import time
import weakref

import zmq
import zmq.asyncio
from zmq.utils.monitor import recv_monitor_message

from app.errors import DeadlineExceeded, ProtocolError, SidecarGone
from app.transfer.control.framing import ONE_WAY, ClientClosed, corr_ids
from app.transfer.wire.codec import decode, encode
from app.transfer.wire.protocol import AnyMsg, Msg

# A one-way message to the sidecar waits this long for room in the queue.
_SYNC_NOTIFY_TIMEOUT_S = 1.0


class SyncClient:
    """Blocking DEALER for engine workers. Use from one thread only (ZMQ sockets are not
    thread-safe); create it in the process that uses it, after any fork.

    The socket's monitor tells when the sidecar closed its end (its process exited, killed or
    stopped): from then until a sidecar accepts the connection again, calls raise
    ``SidecarGone`` at once, and a call waiting for its reply stops waiting, instead of each
    running out its deadline. A sidecar that only stalls keeps its end open: calls then wait
    their deadlines as before.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        ctx: zmq.Context | None = None,
        notify_timeout: float = _SYNC_NOTIFY_TIMEOUT_S,
    ) -> None:
        self.endpoint = endpoint
        self._own_ctx = ctx is None
        if ctx is None:
            ctx = zmq.Context()
        elif isinstance(ctx, zmq.asyncio.Context):
            # An asyncio context would hand out asyncio sockets; share its I/O threads instead.
            ctx = zmq.Context.shadow(ctx.underlying)
        self._ctx = ctx
        self._sock = ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        self._sock.connect(endpoint)
        # Also at garbage collection: a context collected before its monitored socket's monitor
        # is disabled blocks forever in term() (a link dropped without close() hung a test).
        self._shut = weakref.finalize(
            self, _shut, self._sock, self._monitor, ctx if self._own_ctx else None
        )
        self.gone_since: float | None = None  # monotonic time the sidecar closed its end
        self.connects = 0  # connections a sidecar accepted: a new one follows a gone one
        self._notify_timeout = notify_timeout
        self._next_corr = corr_ids()
        self._closed = False
        self.requests = 0
        self.notifies = 0
        self.dropped = 0

    @property
    def gone(self) -> bool:
        """The sidecar closed its end of the connection and none has connected since."""
        self._read_monitor()
        return self.gone_since is not None

    def counters(self) -> dict[str, int]:
        return {"requests": self.requests, "notifies": self.notifies, "dropped": self.dropped}

    def request(self, msg: Msg, timeout: float) -> AnyMsg:
        """Send ``msg`` and block for its reply; ``Error`` replies are returned, not raised."""
        self._check_open()
        self._check_peer(msg)
        deadline = time.monotonic() + timeout
        corr = self._next_corr()
        self.requests += 1
        what = type(msg).__name__
        err = f"no reply from {self.endpoint} to {what} within {timeout}s"
        self._send([corr, encode(msg)], deadline, err)
        while True:
            if not self._wait(zmq.POLLIN, deadline):
                raise DeadlineExceeded(err)
            frames = self._sock.recv_multipart(zmq.NOBLOCK)
            if len(frames) != 2 or frames[0] != corr:
                self.dropped += 1  # a late reply to an earlier request that timed out
                continue
            try:
                return decode(frames[1])
            except ProtocolError as e:
                raise ProtocolError(f"reply from {self.endpoint}: {e}") from None

    def notify(self, msg: Msg) -> None:
        """Send ``msg`` one-way. Returns at once unless the queue to the sidecar is full; then
        waits up to ``notify_timeout`` and raises ``DeadlineExceeded``.
        """
        self._check_open()
        self._check_peer(msg)
        err = (
            f"could not queue {type(msg).__name__} to {self.endpoint} within "
            f"{self._notify_timeout}s: the sidecar is not reading"
        )
        self._send([ONE_WAY, encode(msg)], time.monotonic() + self._notify_timeout, err)
        self.notifies += 1

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._shut()

    def _check_open(self) -> None:
        if self._closed:
            raise ClientClosed(f"client to {self.endpoint} is closed")

    def _read_monitor(self) -> None:
        while self._monitor.poll(0):
            event = recv_monitor_message(self._monitor, zmq.NOBLOCK)["event"]
            if event == zmq.EVENT_DISCONNECTED and self.gone_since is None:
                self.gone_since = time.monotonic()
            elif event == zmq.EVENT_CONNECTED:
                self.gone_since = None
                self.connects += 1

    def _check_peer(self, msg: Msg) -> None:
        if self.gone:
            assert self.gone_since is not None
            raise SidecarGone(
                f"{type(msg).__name__} not sent: the sidecar at {self.endpoint} closed its "
                f"connection {time.monotonic() - self.gone_since:.1f}s ago (exited or killed) "
                "and none has connected since"
            )

    def _send(self, frames: list[bytes], deadline: float, err: str) -> None:
        while True:
            try:
                self._sock.send_multipart(frames, zmq.NOBLOCK)
                return
            except zmq.Again:
                if not self._wait(zmq.POLLOUT, deadline):
                    raise DeadlineExceeded(err) from None

    def _wait(self, event: int, deadline: float) -> bool:
        """Until ``event`` on the socket (True), the deadline (False), or the sidecar closing
        its end (``SidecarGone``: a reply or room in its queue will never come)."""
        poller = zmq.Poller()
        poller.register(self._sock, event)
        poller.register(self._monitor, zmq.POLLIN)
        while True:
            remaining_ms = max(0, int((deadline - time.monotonic()) * 1000))
            ready = dict(poller.poll(remaining_ms))
            if self._monitor in ready:
                self._read_monitor()
                if self.gone_since is not None:
                    raise SidecarGone(
                        f"the sidecar at {self.endpoint} closed its connection while this "
                        "call waited (exited or killed)"
                    )
            if self._sock in ready:
                return True
            if time.monotonic() >= deadline:
                return False


def _shut(sock: zmq.Socket, monitor: zmq.Socket, ctx: zmq.Context | None) -> None:
    sock.disable_monitor()
    monitor.close(linger=0)
    sock.close(linger=0)
    if ctx is not None:
        ctx.term()
