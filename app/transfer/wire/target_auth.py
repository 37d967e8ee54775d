"""Signed targets: decode's sidecar vouches for where prefill may write.

A target (:class:`~app.transfer.wire.protocol.RemoteTarget`) names a host and port that prefill's
sidecar connects to, and blocks it then writes. It travels through HTTP (the proxy, the prefill
sidecar's ``/v1/kv_targets``) where anyone on the network could post one. So decode's sidecar
signs every target it hands out with the control-plane key, and prefill's sidecar uses none
whose signature does not check, before it connects anywhere::

    signature = hex(HMAC-SHA256(key, DOMAIN | msgpack(target with signature "")))

The domain keeps a target's signature from ever reading as a control frame's tag (same key).
Decode signs only targets that name itself (its engine id, epoch and control port), so a signed
target cannot point prefill at a third host. A replayed target cannot do harm: decode accepts a
write only for a request it expects, in the epoch it runs, and a send takes one target only.
That last rule would let a target signed for one transfer, posted for another, take that
other's place and end it (its claim at decode fails, and its own target then finds it ended):
so a send takes only a target whose signed ``request_id`` is its own (:func:`check_bound`).
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass, field

import msgspec

from app.errors import AuthError
from app.transfer.wire.auth import FrameAuth
from app.transfer.wire.protocol import RemoteTarget

__all__ = ["DOMAIN", "TargetSigner", "check_bound"]

DOMAIN = b"kv-sidecar target v1\x00"


@dataclass(frozen=True)
class TargetSigner:
    """Signs and checks targets with the control plane's key (never shown in repr)."""

    key: bytes = field(repr=False)

    @classmethod
    def of(cls, auth: FrameAuth) -> TargetSigner:
        return cls(auth.key)

    def _mac(self, target: RemoteTarget) -> str:
        unsigned = msgspec.structs.replace(target, signature="")
        body = DOMAIN + msgspec.msgpack.encode(unsigned)
        return hmac.new(self.key, body, hashlib.sha256).hexdigest()

    def sign(self, target: RemoteTarget) -> RemoteTarget:
        """``target`` with its signature."""
        return msgspec.structs.replace(target, signature=self._mac(target))

    def verify(self, target: RemoteTarget) -> None:
        """Raise :class:`AuthError` unless ``target`` was signed with this key, unchanged."""
        if not target.signature:
            raise AuthError(
                f"target for {target.request_id} is not signed: expected one signed by decode's "
                "sidecar (a decode connector and sidecar of this release, sharing the control-"
                "plane key with this one)"
            )
        if not hmac.compare_digest(target.signature, self._mac(target)):
            raise AuthError(
                f"target for {target.request_id}: bad signature (not signed with this sidecar's "
                "control-plane key, or changed after signing)"
            )


def check_bound(target: RemoteTarget, transfer_id: str) -> None:
    """Raise :class:`AuthError` unless ``target`` is decode's target for ``transfer_id``.

    Checked after the signature (which covers ``request_id``): a good signature vouches for
    decode's blocks of that one transfer, not for a send of another."""
    if target.request_id != transfer_id:
        raise AuthError(
            f"target signed for transfer {target.request_id!r} was posted for {transfer_id!r}: "
            f"expected decode's target for {transfer_id!r} (request_id {transfer_id!r}); a "
            "signature vouches only for the transfer it names"
        )
