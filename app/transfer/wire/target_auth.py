"""Signed targets: decode's sidecar vouches for where prefill may write, and for which prompt.

A target (:class:`~app.transfer.wire.protocol.RemoteTarget`) names a host and port that prefill's
sidecar connects to, and blocks it then writes. It travels through HTTP (the proxy, the prefill
sidecar's ``/v1/kv_targets``) where anyone on the network could post one. So decode's sidecar
signs every target it hands out with the control-plane key, and prefill's sidecar uses none
whose signature does not check, before it connects anywhere::

    signature = hex(HMAC-SHA256(key, DOMAIN | msgpack(target with signature "")))

The domain keeps a target's signature from ever reading as a control frame's tag (same key).
Decode signs only targets that name itself (its engine id, epoch and control port), so a signed
target cannot point prefill at a third host.

A signature alone vouches for decode's blocks, not for what is written into them: a target seen
once (on the proxy -> prefill leg, say) could be posted to a prefill engine with another prompt,
and that prompt's KV would land in the victim's blocks. So a target binds both the transfer
(``request_id``, the proxy's transfer id) and the prompt decode holds (``prompt_digest``, see
:func:`prompt_digest`), and a send takes only a target whose two equal its own: the transfer id
prefill's engine runs the request under and the digest of the prompt it computes
(:func:`check_bound`). Targets of format 1 (before the digest) are refused by name
(:meth:`TargetSigner.verify`): none of them binds a prompt.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field

import msgspec

from app.errors import AuthError, ProtocolError
from app.transfer.wire.auth import FrameAuth
from app.transfer.wire.protocol import TARGET_FORMAT, RemoteTarget

__all__ = ["DOMAIN", "TARGET_FORMAT", "TargetSigner", "check_bound", "prompt_digest"]

DOMAIN = b"kv-sidecar target v2\x00"
_PROMPT_DOMAIN = b"kv-sidecar prompt v1\x00"


def prompt_digest(token_ids: Sequence[int], inputs: Sequence[tuple[str | int, ...]] = ()) -> str:
    """The prompt a target binds: hex SHA-256 over its length and its token ids, each a
    little-endian int64, then ``inputs`` (what else decides its KV: an adapter, images) as
    msgpack. Decode takes it over the prompt it holds; prefill over the whole prompt its engine
    runs (before it drops the last token, which decode computes)."""
    ids = array("q", token_ids)  # raises OverflowError for an id past int64: none is
    if sys.byteorder != "little":
        ids.byteswap()
    h = hashlib.sha256(_PROMPT_DOMAIN)
    h.update(struct.pack("<q", len(ids)))
    h.update(ids.tobytes())
    if inputs:
        h.update(msgspec.msgpack.encode(list(inputs)))
    return h.hexdigest()


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
        """``target`` in this release's format, with its signature."""
        current = msgspec.structs.replace(target, format=TARGET_FORMAT, signature="")
        return msgspec.structs.replace(current, signature=self._mac(current))

    def verify(self, target: RemoteTarget) -> None:
        """Raise :class:`AuthError` unless ``target`` is of this format and was signed with this
        key, unchanged."""
        if target.format != TARGET_FORMAT:
            # Said first: an older decode's target fails the signature too, but "bad signature"
            # would send an operator looking for a key mismatch.
            raise AuthError(
                f"target for {target.request_id} is of format {target.format}: expected format "
                f"{TARGET_FORMAT}, which binds the target to decode's prompt (format 1 targets "
                "come from decode sidecars of an older release and bind none); upgrade decode's "
                "sidecar and connector"
            )
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


def check_bound(target: RemoteTarget, transfer_id: str, digest: str) -> None:
    """Raise :class:`AuthError` unless ``target`` is decode's target for ``transfer_id`` and the
    prompt whose digest is ``digest`` (the send's, as prefill's engine runs it).

    Checked after the signature (which covers both): a good signature vouches for decode's
    blocks of one transfer and one prompt, not for a send of another."""
    if target.request_id != transfer_id:
        raise AuthError(
            f"target signed for transfer {target.request_id!r} was posted for {transfer_id!r}: "
            f"expected decode's target for {transfer_id!r} (request_id {transfer_id!r}); a "
            "signature vouches only for the transfer it names"
        )
    if not target.prompt_digest:
        raise AuthError(
            f"target for {transfer_id!r} binds no prompt (its prompt_digest is empty): expected "
            "the digest of the prompt decode holds; nothing is written to a target that any "
            "prompt could fill"
        )
    if not digest or not hmac.compare_digest(target.prompt_digest, digest):
        raise AuthError(
            f"target for {transfer_id!r} was signed for another prompt: decode holds the prompt "
            f"with digest {target.prompt_digest[:16]}..., prefill's engine runs "
            f"{digest[:16] + '...' if digest else 'one without a digest'}; nothing is written "
            "to decode's blocks"
        )


def check_target(target: RemoteTarget, groups: int, most_blocks: int) -> None:
    """A target's block ids against the send it is for: one list per KV cache group, none
    longer than ``most_blocks`` (a block holds at least one token). Raises ProtocolError."""
    if len(target.block_ids) != groups:
        raise ProtocolError(
            f"target for {target.request_id}: expected block ids for {groups} KV cache "
            f"groups (the send's), got {len(target.block_ids)}"
        )
    longest = max((len(ids) for ids in target.block_ids), default=0)
    if longest > most_blocks:
        raise ProtocolError(
            f"target for {target.request_id}: expected at most {most_blocks} block ids per "
            f"group for this prompt, got {longest}"
        )


def remote_target(obj: object) -> RemoteTarget:
    """A target as it came over JSON (``kv_transfer_params["remote"]``), checked field by field.

    Strict: a port sent as a string is refused, not coerced, so a target from something other
    than our connector fails here rather than somewhere in the sidecar.
    """
    try:
        return msgspec.convert(obj, RemoteTarget)
    except msgspec.ValidationError as e:
        raise ProtocolError(f"invalid remote target: {e}") from None
