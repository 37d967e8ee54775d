"""Authentication of the peer control plane: an HMAC-SHA256 over every frame.

Without it, anyone who reaches a control port can send ``Hello`` and get back decode's Mooncake
session, epoch and region addresses, or forge a ``Done`` / ``Abort``. With it, both sidecars hold
one shared key and every payload travels sealed::

    version (1 byte) | timestamp (8 bytes, big-endian ms since the Unix epoch) | tag (32) | payload

where ``tag = HMAC-SHA256(key, version | timestamp | payload)``. :meth:`FrameAuth.open` checks the
version, then the tag (constant time), then that the timestamp is within ``MAX_SKEW_S`` of this
host's clock. It authenticates, it does not encrypt: the payload stays readable on the wire.

Keys (:func:`load_auth`): ``KVSIDECAR_AUTH_KEY_FILE`` (a mounted Secret) or ``KVSIDECAR_AUTH_KEY``;
with neither and a loopback control host, a per-user key file that the first sidecar of the user
creates and every later one reads (:func:`user_key`), so local demos and tests need no setup.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
import struct
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from app.config.values import _is_loopback, env_var_for
from app.errors import AuthError, ConfigError

if TYPE_CHECKING:
    from app.config import SidecarSettings

__all__ = [
    "AUTH_VERSION",
    "MAX_SKEW_S",
    "MIN_KEY_BYTES",
    "OVERHEAD",
    "UNAUTHENTICATED_REASON",
    "FrameAuth",
    "load_auth",
    "read_key_file",
    "user_key",
    "user_key_path",
]

AUTH_VERSION = 1
_HEADER = struct.Struct(">BQ")  # version, timestamp in ms
_TAG_BYTES = hashlib.sha256().digest_size
OVERHEAD = _HEADER.size + _TAG_BYTES
"""Bytes a sealed frame adds to its payload (41)."""
# 256 bits: the HMAC-SHA256 key size that gives its full strength.
MIN_KEY_BYTES = 32
# Why 60 s: a replayed frame is accepted only inside this window, so it should be short; but NTP
# keeps nodes within milliseconds and a request may wait in a DEALER queue while its peer
# reconnects, so a few seconds would fail honest traffic. A minute covers a badly synced node.
MAX_SKEW_S = 60.0
# A key file is a few dozen bytes; reading more would mean a wrong path (a log, /dev/zero).
_MAX_KEY_FILE_BYTES = 4096

UNAUTHENTICATED_REASON = (
    "frame not authenticated: it is not sealed with this sidecar's control-plane key. Likely "
    "cause: the two sidecars have different keys (KVSIDECAR_AUTH_KEY_FILE or KVSIDECAR_AUTH_KEY "
    "must give both the same key; a sidecar without auth sends unsealed frames), or their clocks "
    f"differ by more than {MAX_SKEW_S:g} s"
)
"""The one reply an unauthenticated frame gets: fixed text, nothing about this sidecar."""


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


@dataclass(frozen=True)
class FrameAuth:
    """Seals and opens control-plane payloads with one shared key (never shown in repr)."""

    key: bytes = field(repr=False)
    # The keyed HMAC state, computed once: a copy per frame is half the cost of keying anew.
    _mac: hmac.HMAC = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if len(self.key) < MIN_KEY_BYTES:
            raise ConfigError(
                f"control-plane key: expected at least {MIN_KEY_BYTES} bytes, got {len(self.key)}"
            )
        object.__setattr__(self, "_mac", hmac.new(self.key, digestmod=hashlib.sha256))

    def _tag(self, header: bytes, payload: bytes) -> bytes:
        mac = self._mac.copy()
        mac.update(header)
        mac.update(payload)
        return mac.digest()

    def seal(self, payload: bytes, *, at_ms: int | None = None) -> bytes:
        """``payload`` with the auth header and tag in front; ``at_ms`` defaults to now."""
        header = _HEADER.pack(AUTH_VERSION, _now_ms() if at_ms is None else at_ms)
        return header + self._tag(header, payload) + payload

    def open(self, sealed: bytes, *, now_ms: int | None = None) -> bytes:
        """The payload of a sealed frame; raises :class:`AuthError` unless it is authentic and
        fresh."""
        if len(sealed) < OVERHEAD:
            raise AuthError(
                f"expected a sealed frame of at least {OVERHEAD} bytes, got {len(sealed)}"
            )
        version, at_ms = _HEADER.unpack_from(sealed)
        if version != AUTH_VERSION:
            # An unsealed msgpack message starts with a map byte (0x8_ or 0xde) here.
            raise AuthError(
                f"expected auth version {AUTH_VERSION}, got {version:#04x} (an unsealed frame "
                "from a sidecar without auth, or another release)"
            )
        header, tag = sealed[: _HEADER.size], sealed[_HEADER.size : OVERHEAD]
        payload = sealed[OVERHEAD:]
        if not hmac.compare_digest(tag, self._tag(header, payload)):
            raise AuthError("bad tag: the frame was not sealed with this key, or was changed")
        # Checked after the tag, so a skew error is about a frame the key holder really sent.
        skew_s = ((_now_ms() if now_ms is None else now_ms) - at_ms) / 1000
        if abs(skew_s) > MAX_SKEW_S:
            when = "old" if skew_s > 0 else "in the future"
            raise AuthError(
                f"timestamp {abs(skew_s):.1f} s {when}: expected within {MAX_SKEW_S:g} s of this "
                "clock (clock skew between the hosts, or a replayed frame)"
            )
        return payload


def read_key_file(path: Path, what: str = "key file") -> bytes:
    """The key material of ``path``: its bytes without surrounding whitespace, at least
    ``MIN_KEY_BYTES``. Raises ConfigError saying what is wrong."""
    try:
        with path.open("rb") as f:
            return _material(f.read(_MAX_KEY_FILE_BYTES + 1), path, what)
    except OSError as e:
        raise ConfigError(f"{what} {path} cannot be read: {e.strerror or e}") from None


def _material(raw: bytes, path: Path, what: str) -> bytes:
    if len(raw) > _MAX_KEY_FILE_BYTES:
        raise ConfigError(
            f"{what} {path}: expected a key of a few dozen bytes, got more than "
            f"{_MAX_KEY_FILE_BYTES}; is the path right?"
        )
    # A trailing newline (echo, kubectl --from-file) is not key material, and one side having it
    # while the other does not must not make the keys differ.
    material = raw.strip()
    if len(material) < MIN_KEY_BYTES:
        raise ConfigError(
            f"{what} {path}: expected at least {MIN_KEY_BYTES} bytes of key material, got "
            f"{len(material)}; write e.g. the output of "
            "`python -c 'import secrets; print(secrets.token_hex(32))'`"
        )
    return material


def user_key_path() -> Path:
    """Where this user's generated key lives: ``$XDG_RUNTIME_DIR/kv-sidecar/auth.key``, else
    ``/tmp/kv-sidecar-<uid>/auth.key`` (not ``$TMPDIR``: every process of the user must agree)."""
    runtime = os.environ.get("XDG_RUNTIME_DIR", "")
    if runtime and Path(runtime).is_dir():
        return Path(runtime) / "kv-sidecar" / "auth.key"
    return Path("/tmp") / f"kv-sidecar-{os.getuid()}" / "auth.key"


def _check_private(st: os.stat_result, path: Path, kind: str) -> None:
    """Refuse what another user owns or can open: they could have planted or read the key."""
    problems = []
    if st.st_uid != os.getuid():
        problems.append(f"owned by uid {st.st_uid}, not {os.getuid()}")
    if st.st_mode & 0o077:
        problems.append(f"mode {stat.S_IMODE(st.st_mode):o} lets others in")
    if problems:
        raise ConfigError(
            f"{kind} {path} is {' and '.join(problems)}: expected one only this user can open "
            f"(0700 folder, 0600 file). Remove it, or set {env_var_for('auth_key_file')}."
        )


def user_key(path: Path | None = None) -> bytes:
    """This user's generated key at ``path`` (default :func:`user_key_path`), created if absent.

    Many sidecars may start at once: the first to create the file wins and the others read it.
    The key is written to a private temporary file first and then ``link(2)``-ed into place, which
    fails with EEXIST when the name exists: the exclusive create of ``O_CREAT | O_EXCL``, but a
    reader can never see a half-written key.
    """
    path = path or user_key_path()
    folder = path.parent
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = folder.lstat()
    except OSError as e:
        raise ConfigError(f"key folder {folder} cannot be created: {e.strerror or e}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"key folder {folder} is not a directory (a symlink?); remove it")
    _check_private(st, folder, "key folder")
    for _ in range(3):  # absent -> lost the race -> read the winner's; never loops further
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            material = _create_key(path)
            if material is not None:
                return material
            continue
        except OSError as e:  # ELOOP: a symlink where the key should be
            raise ConfigError(f"key file {path} cannot be opened: {e.strerror or e}") from None
        # Checked and read through one descriptor: what was checked is what is read.
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise ConfigError(f"key file {path} is not a regular file; remove it")
            _check_private(st, path, "key file")
            return _material(f.read(_MAX_KEY_FILE_BYTES + 1), path, "key file")
    raise ConfigError(f"key file {path} keeps disappearing; is something deleting it?")


def _create_key(path: Path) -> bytes | None:
    """Write a new key to ``path``; None when another process created it first."""
    material = secrets.token_hex(MIN_KEY_BYTES).encode()
    # mkstemp: O_CREAT | O_EXCL, mode 0600, a name nobody else can have chosen.
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".auth.key.")
    try:
        try:
            os.write(fd, material + b"\n")
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, path)
        except FileExistsError:
            return None
    except OSError as e:
        raise ConfigError(f"key file {path} cannot be created: {e.strerror or e}") from None
    finally:
        Path(tmp).unlink(missing_ok=True)
    return material


def load_auth(settings: SidecarSettings) -> FrameAuth:
    """The control plane's :class:`FrameAuth` from the settings: ``auth_key_file``, else
    ``auth_key``, else (loopback control host only) this user's generated key."""
    if settings.auth_key_file is not None:
        what = f"{env_var_for('auth_key_file')}: key file"
        return FrameAuth(read_key_file(settings.auth_key_file, what))
    if settings.auth_key is not None:
        material = settings.auth_key.get_secret_value().strip().encode()
        if len(material) < MIN_KEY_BYTES:  # the settings check this; FrameAuth would too
            raise ConfigError(
                f"{env_var_for('auth_key')}: expected at least {MIN_KEY_BYTES} bytes of key, "
                f"got {len(material)}"
            )
        return FrameAuth(material)
    if _is_loopback(settings.control_host):
        return FrameAuth(user_key())
    raise ConfigError(
        f"control_host {settings.control_host} is reachable from other hosts but no "
        f"control-plane key is set: mount a Secret holding at least {MIN_KEY_BYTES} random bytes "
        f"and set {env_var_for('auth_key_file')} to its file (k8s/auth-key-secret.example.yaml)"
    )
