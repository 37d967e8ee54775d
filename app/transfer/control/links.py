"""How the request state machines reach a remote sidecar: the calls they make, and ZMQ's.

``SendSide``, ``RecvSide``, ``Peers`` and ``Registry`` only ask a peer something and wait for the
answer (``Hello``, ``Ping``, ``Claim``, ``Done``, ``Abort``, ``NewEpoch``), close the link, and
ask whether the sidecar behind it is gone. They see a :class:`PeerLink`, so that their rules can
be exercised without processes; the sidecar hands them :func:`zmq_links`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Protocol

import zmq.asyncio

from app.transfer.control.client import PeerClient
from app.transfer.wire.auth import FrameAuth
from app.transfer.wire.protocol import AnyMsg, Msg


class PeerLink(Protocol):
    """Request/reply with one remote sidecar's control port."""

    async def request(self, msg: Msg, timeout: float) -> AnyMsg:
        """Send ``msg`` and return its reply (``Error`` is returned); raises
        ``DeadlineExceeded`` after ``timeout`` and ``KVSidecarError`` when closed."""
        ...

    async def gone(self) -> bool:
        """Whether the sidecar behind the link is known to be gone (not merely silent)."""
        ...

    async def close(self) -> None: ...


# endpoint -> a link of its own to it (the caller closes it)
Connect = Callable[[str], PeerLink]


class ZmqLink:
    """A :class:`PeerLink` over a ZMQ ``PeerClient``."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        endpoint: str,
        *,
        auth: FrameAuth | None,
        max_frame_bytes: int,
    ) -> None:
        self.endpoint = endpoint
        self._client = PeerClient(ctx, endpoint, auth=auth, max_frame_bytes=max_frame_bytes)

    async def request(self, msg: Msg, timeout: float) -> AnyMsg:
        return await self._client.request(msg, timeout)

    async def gone(self) -> bool:
        return await refused(self.endpoint)

    async def close(self) -> None:
        await self._client.close()


def zmq_links(ctx: zmq.asyncio.Context, auth: FrameAuth | None, max_frame_bytes: int) -> Connect:
    """Links over ``ctx``, sealed with ``auth``, replies capped at ``max_frame_bytes``."""

    def connect(endpoint: str) -> PeerLink:
        return ZmqLink(ctx, endpoint, auth=auth, max_frame_bytes=max_frame_bytes)

    return connect


async def refused(endpoint: str, timeout_s: float = 1.0) -> bool:
    """Whether a TCP connection to ``endpoint`` is refused: nothing listens there, so the
    sidecar that did is gone, and so are its transfer engine's writes. A stopped (SIGSTOP) or
    unreachable one is not refused: its kernel still accepts, or nothing answers at all."""
    host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
    try:
        async with asyncio.timeout(timeout_s):
            _, writer = await asyncio.open_connection(host.strip("[]"), int(port))
    except ConnectionRefusedError:
        return True
    except (OSError, TimeoutError, ValueError):
        return False
    writer.close()
    return False
