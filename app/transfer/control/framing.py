"""ZMQ request/response plane (DESIGN §4): sidecar <-> sidecar and engine <-> sidecar.

One ``ControlServer`` (a ROUTER, in ``control.server``) serves the peer control port
(``tcp://``) and another the engines' socket (``ipc://``). ``PeerClient`` (asyncio DEALER, in
``control.client``) talks to a remote sidecar; ``SyncClient`` (blocking DEALER, in
``app.engine_link.sync_client``) is for engine workers, which are synchronous code. This module
holds what they share: the framing constants, ``ClientClosed``, ``LogThrottle``.

Framing, fixed:

- A client sends two frames ``[corr_id, payload]``: ``corr_id`` is 8 bytes (a big-endian
  per-client counter starting at 1) and ``payload`` is ``codec.encode(msg)``.
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

Authentication (``auth``, a :class:`~app.transfer.wire.auth.FrameAuth`; the peer port has one, the
engines' same-pod ``ipc://`` socket does not): every ``payload`` is sealed (an HMAC header in
front of ``codec.encode(msg)``). The server opens each frame after the size cap (which applies
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

import itertools
import logging
import struct
import time
from collections.abc import Awaitable, Callable

from app.errors import KVSidecarError
from app.transfer.wire.protocol import AnyMsg, Msg

__all__ = [
    "DEFAULT_ENGINE_FRAME_BYTES",
    "DEFAULT_MAX_FRAME_BYTES",
    "ONE_WAY",
    "ClientClosed",
    "Handler",
    "LogThrottle",
]

# The control plane logs under one name, whichever module logs (operators filter on it).
log = logging.getLogger("app.transfer.control")

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
