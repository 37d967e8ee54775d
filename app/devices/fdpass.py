"""Handing file descriptors to another process over a unix socket (SCM_RIGHTS).

cuMem allocations are shared as POSIX file descriptors (``cuMemExportToShareableHandle``), and
a descriptor only means something inside the process that holds it: the engine serves its
descriptors on a unix socket, the sidecar connects, proves it was told the registration's
token, and receives them. A SEQPACKET socket keeps each batch of descriptors with its header.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import os
import socket
import struct
import threading
from collections.abc import Sequence

from app.errors import ConfigError

log = logging.getLogger(__name__)

# The kernel takes at most 253 descriptors per message (SCM_MAX_FD).
_BATCH = 200
_HEADER = struct.Struct("!4sI")  # b"KVFD", number of descriptors in this message


class FdServer:
    """Serves ``fds`` to every client on ``path`` that sends ``token`` first (a daemon
    thread); ``close`` stops it, removes the socket and closes the descriptors."""

    def __init__(self, path: str, fds: Sequence[int], token: bytes) -> None:
        self.path, self._fds, self._token = path, list(fds), token
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        self._sock.bind(path)
        os.chmod(path, 0o600)  # and the token: another user's process gets nothing
        self._sock.listen(4)
        self._sock.settimeout(0.2)  # so that ``close`` stops the loop promptly
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kvs-fds", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # closed under us
            with conn:
                try:
                    self._answer(conn)
                except OSError as e:
                    log.warning("descriptor client on %s went away: %s", self.path, e)

    def _answer(self, conn: socket.socket) -> None:
        conn.settimeout(5.0)
        got = conn.recv(256)
        if not hmac.compare_digest(got, self._token):
            conn.send(_HEADER.pack(b"DENY", 0))
            return
        for i in range(0, len(self._fds), _BATCH):
            batch = self._fds[i : i + _BATCH]
            socket.send_fds(conn, [_HEADER.pack(b"KVFD", len(batch))], batch)
        conn.send(_HEADER.pack(b"DONE", len(self._fds)))

    def close(self) -> None:
        self._stop.set()
        self._sock.close()
        self._thread.join(1.0)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        _close(self._fds)
        self._fds = []


def receive_fds(path: str, token: bytes, count: int, timeout_s: float = 10.0) -> list[int]:
    """The ``count`` descriptors served on ``path``; the caller owns (and closes) them."""
    fds: list[int] = []
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
            sock.settimeout(timeout_s)
            try:
                sock.connect(path)
            except (FileNotFoundError, ConnectionRefusedError) as e:
                raise ConfigError(
                    f"the engine's descriptor socket {path} is not reachable ({e}); the "
                    "sidecar must share the engine's /dev/shm (same pod, or a shared "
                    "emptyDir at /dev/shm)"
                ) from None
            sock.send(token)
            while True:
                msg, got, _, _ = socket.recv_fds(sock, _HEADER.size, _BATCH)
                fds += got
                tag, n = _HEADER.unpack(msg) if len(msg) == _HEADER.size else (b"", 0)
                if tag == b"KVFD" and n == len(got):
                    continue
                if tag == b"DONE" and n == count == len(fds):
                    return fds
                raise ConfigError(
                    f"descriptor socket {path}: expected {count} descriptors, got "
                    f"{len(fds)} and {tag!r} {n} (a denied token, or an engine that "
                    "exported something else)"
                )
    except OSError as e:
        _close(fds)
        raise ConfigError(f"descriptor socket {path}: {e}") from None
    except BaseException:
        _close(fds)
        raise


def _close(fds: Sequence[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
