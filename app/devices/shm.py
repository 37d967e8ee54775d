"""KV memory shared between an engine and its sidecar as POSIX shared memory (CPU).

Segments live in ``/dev/shm`` under names the engine chooses; the sidecar maps them by name and
registers its own mapping with Mooncake, so peers write straight into the engine's cache.
``multiprocessing.shared_memory`` is avoided on purpose: on Python 3.11 its resource tracker
unlinks segments when an *attaching* process exits, which would pull the cache from under a
live engine when a sidecar restarts.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from app.errors import ConfigError

if TYPE_CHECKING:
    import torch

SHM_DIR = "/dev/shm"


def _path(name: str) -> str:
    if "/" in name or not name:
        raise ConfigError(f"bad shared-memory name {name!r}: expected a plain file name")
    return os.path.join(SHM_DIR, name)


def _open(name: str) -> int:
    try:
        return os.open(_path(name), os.O_RDWR)
    except FileNotFoundError:
        raise ConfigError(
            f"shared memory {name!r} does not exist; is the engine alive and sharing /dev/shm "
            "with the sidecar?"
        ) from None


def _mmap(fd: int, size: int) -> mmap.mmap:
    return mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)


def create_file(name: str, nbytes: int) -> mmap.mmap:
    """A new zero-filled shared-memory file, mapped; fails if ``name`` exists."""
    fd = os.open(_path(name), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, nbytes)
        return _mmap(fd, nbytes)
    finally:
        os.close(fd)


def open_file(
    name: str, nbytes: int, why: str = "what it holds (different versions?)"
) -> mmap.mmap:
    """Map another process's shared-memory file of exactly ``nbytes``; ``why``: what engine
    and sidecar must disagree on when the size differs."""
    fd = _open(name)
    try:
        size = os.fstat(fd).st_size
        if size != nbytes:
            raise ConfigError(
                f"shared memory {name!r} has {size} bytes, expected {nbytes}; engine and "
                f"sidecar disagree on {why}"
            )
        return _mmap(fd, nbytes)
    finally:
        os.close(fd)


def unlink_file(name: str) -> None:
    """Remove a shared-memory name (mappings stay valid); a missing name is fine."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(_path(name))


@dataclass
class ShmArena:
    """Segments created by one engine rank; ``allocator`` plugs into ``layout.allocate``."""

    prefix: str = field(default_factory=lambda: f"kvs-{secrets.token_hex(4)}")
    names: list[str] = field(default_factory=list)

    def allocator(self, nbytes: int) -> torch.Tensor:
        import torch  # engine side only: the sidecar maps files without it

        name = f"{self.prefix}-{len(self.names)}"
        tensor = torch.frombuffer(create_file(name, nbytes), dtype=torch.uint8)
        self.names.append(name)
        return tensor

    def unlink(self) -> None:
        """Remove the names (mappings stay valid until every process drops them)."""
        for name in self.names:
            unlink_file(name)
        self.names.clear()


def attach_allocator(names: list[str]) -> Callable[[int], torch.Tensor]:
    """An allocator that maps the engine's segments, in the order the engine created them."""
    queue = list(names)

    def allocate(nbytes: int) -> torch.Tensor:
        import torch

        if not queue:
            raise ConfigError(f"engine registered {len(names)} segments, the layout needs more")
        mm = open_file(queue.pop(0), nbytes, "model, TP or block settings")
        return torch.frombuffer(mm, dtype=torch.uint8)

    return allocate


@dataclass(frozen=True)
class MappedFile:
    """An engine's file mapped into the sidecar; the mapping lives as long as this value."""

    mapping: mmap.mmap
    address: int

    @classmethod
    def of(cls, fd: int, size: int) -> MappedFile:
        mm = _mmap(fd, size)
        # ctypes, not torch: a CPU sidecar only needs the address (torch is 2 s per start).
        return cls(mm, ctypes.addressof(ctypes.c_char.from_buffer(mm)))

    def data_ptr(self) -> int:
        """The mapping's first byte, as ``torch.Tensor.data_ptr`` gives a device buffer's."""
        return self.address


def map_engine_file(name: str, min_size: int) -> MappedFile:
    """Map a shared-memory file the engine made (e.g. torch's own shared storage) whole."""
    fd = _open(name)
    try:
        return map_engine_fd(fd, min_size, name)
    finally:
        os.close(fd)


def map_engine_fd(fd: int, min_size: int, name: str) -> MappedFile:
    """Map the whole file behind ``fd`` (the engine's file ``name``); the caller closes
    ``fd``, the mapping stays."""
    size = os.fstat(fd).st_size
    if size < min_size:
        raise ConfigError(
            f"shared memory {name!r} has {size} bytes, the engine registered {min_size}"
        )
    return MappedFile.of(fd, size)
