"""One exception root for the project, with a subclass per failure a caller can act on."""

from __future__ import annotations


class KVSidecarError(Exception):
    """Root of every error the sidecar raises on purpose."""


class ConfigError(KVSidecarError):
    """A model, TP pairing, block size or setting that cannot work; says what to change."""


class LayoutMismatchError(KVSidecarError):
    """The two sides' layouts fail the validation gate (DESIGN §5)."""


class OutOfBoundsError(KVSidecarError):
    """A descriptor or block id falls outside the peer's registered regions."""


class TransferError(KVSidecarError):
    """A Mooncake submit or transfer failed."""


class ProtocolError(KVSidecarError):
    """A malformed, unknown or wrong-version control message."""


class AuthError(ProtocolError):
    """A control frame that fails authentication: wrong auth version, bad HMAC tag, or a
    timestamp outside the skew window. A ProtocolError, so callers that handle a bad frame or a
    bad reply handle this one too."""


class DeadlineExceeded(KVSidecarError):
    """A wait ran past its deadline."""


class SidecarGone(KVSidecarError):
    """The sidecar closed its end of the engine link (its process exited or was killed): no
    reply will come, so the engine stops waiting for one."""


class PoolError(KVSidecarError):
    """A Mooncake Store operation failed."""


class BenchError(KVSidecarError):
    """A benchmark's stack did not behave as the measurement needs (says what it saw)."""
