"""cuMem-based (virtual memory management) CUDA allocations shared across processes.

PyTorch's expandable segments and vLLM's sleep-mode allocator map physical chunks
(``cuMemCreate``) into a reserved address range; ``cudaIpcGetMemHandle`` refuses such memory.
Each chunk is exported as a POSIX file descriptor (``cuMemExportToShareableHandle``), handed to
the sidecar over a unix socket (``fdpass``), imported (``cuMemImportFromShareableHandle``) and
mapped into one reserved range there, in the same order, so the buffer is contiguous again.

The driver API comes from libcuda through ctypes, loaded on first use: nothing here runs, or
needs CUDA, until a cuMem buffer is exported or imported. The allocation must have been created
with POSIX file descriptor handles requested (PyTorch >= 2.5 does for expandable segments).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

from app.errors import ConfigError

CUDA_SUCCESS = 0
_POSIX_FD = 1  # CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
_PINNED = 1  # CU_MEM_ALLOCATION_TYPE_PINNED
_LOCATION_DEVICE = 1  # CU_MEM_LOCATION_TYPE_DEVICE
_READ_WRITE = 3  # CU_MEM_ACCESS_FLAGS_PROT_READWRITE
_GRANULARITY_MINIMUM = 0


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AccessDesc(ctypes.Structure):
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [
        ("compressionType", ctypes.c_ubyte),
        ("gpuDirectRDMACapable", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
        ("reserved", ctypes.c_ubyte * 4),
    ]


class _AllocProp(ctypes.Structure):
    _fields_ = [
        ("type", ctypes.c_int),
        ("requestedHandleTypes", ctypes.c_int),
        ("location", _Location),
        ("win32HandleMetaData", ctypes.c_void_p),
        ("allocFlags", _AllocFlags),
    ]


@cache
def _lib() -> Any:
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        raise ConfigError(
            "libcuda.so.1 is not loadable in this process: cuMem-shared KV needs the NVIDIA "
            "driver library (run with the GPU and its driver mounted, e.g. the NVIDIA "
            "container runtime)"
        ) from None
    _call(lib, "cuInit", 0)
    return lib


def _call(lib: Any, name: str, *args: Any) -> None:
    rc = getattr(lib, name)(*args)
    if rc != CUDA_SUCCESS:
        text = ctypes.c_char_p()
        lib.cuGetErrorString(rc, ctypes.byref(text))
        raise ConfigError(f"{name} failed: CUDA error {rc} ({(text.value or b'').decode()})")


def _granularity(device: int) -> int:
    prop = _AllocProp(type=_PINNED, location=_Location(_LOCATION_DEVICE, device))
    gran = ctypes.c_size_t()
    _call(_lib(), "cuMemGetAllocationGranularity", ctypes.byref(gran), ctypes.byref(prop), 0)
    return int(gran.value)


def _handle_at(addr: int) -> int | None:
    """The physical allocation mapped at ``addr``, or None (not cuMem memory, or unmapped).
    Retaining returns the handle value used to map it, so equal values mean one chunk."""
    lib = _lib()
    handle = ctypes.c_ulonglong()
    if lib.cuMemRetainAllocationHandle(ctypes.byref(handle), ctypes.c_void_p(addr)):
        return None
    lib.cuMemRelease(handle)
    return int(handle.value)


def is_cumem(addr: int) -> bool:
    """Whether ``addr`` lies in cuMem-mapped memory (False for cudaMalloc memory)."""
    return _handle_at(addr) is not None


@dataclass(frozen=True)
class Chunks:
    """The physical chunks covering a buffer, in address order."""

    start: int  # address of the first chunk
    sizes: tuple[int, ...]
    offset: int  # from ``start`` to the buffer


def chunks(addr: int, nbytes: int, device: int) -> Chunks:
    """Walk the chunks under ``[addr, addr + nbytes)`` granule by granule."""
    gran = _granularity(device)
    first = _handle_at(addr)
    if first is None:
        raise ConfigError(f"address {addr:#x} is not cuMem-mapped memory")
    start = addr - addr % gran
    while start >= gran and _handle_at(start - gran) == first:
        start -= gran
    sizes: list[int] = []
    va, end = start, addr + nbytes
    while va < end:
        handle = _handle_at(va)
        if handle is None:
            raise ConfigError(f"KV buffer at {addr:#x} has an unmapped hole at {va:#x}")
        size = gran
        while _handle_at(va + size) == handle:
            size += gran
        sizes.append(size)
        va += size
    return Chunks(start, tuple(sizes), addr - start)


def export_fds(found: Chunks) -> list[int]:
    """One POSIX descriptor per chunk (the caller closes them)."""
    lib = _lib()
    fds: list[int] = []
    va = found.start
    try:
        for size in found.sizes:
            handle = ctypes.c_ulonglong()
            _call(lib, "cuMemRetainAllocationHandle", ctypes.byref(handle), ctypes.c_void_p(va))
            fd = ctypes.c_int(-1)
            try:
                rc = lib.cuMemExportToShareableHandle(
                    ctypes.byref(fd), handle, _POSIX_FD, ctypes.c_ulonglong(0)
                )
            finally:
                lib.cuMemRelease(handle)
            if rc != CUDA_SUCCESS:
                raise ConfigError(
                    f"cuMemExportToShareableHandle failed (CUDA error {rc}): the KV allocation "
                    "was not created with POSIX file descriptor handles; use PyTorch >= 2.5 "
                    "for expandable segments, or turn expandable_segments off so that the "
                    "cache is shared through CUDA IPC handles"
                )
            fds.append(fd.value)
            va += size
    except BaseException:
        for fd_ in fds:
            os.close(fd_)
        raise
    return fds


class Mapping:
    """Imported chunks mapped contiguously into this process; ``close`` unmaps them."""

    def __init__(self, fds: Sequence[int], sizes: Sequence[int], device: int) -> None:
        lib = _lib()
        self.size = sum(sizes)
        va = ctypes.c_ulonglong()
        _call(
            lib,
            "cuMemAddressReserve",
            ctypes.byref(va),
            ctypes.c_size_t(self.size),
            ctypes.c_size_t(0),  # default alignment: the granularity
            ctypes.c_ulonglong(0),  # no fixed address
            ctypes.c_ulonglong(0),
        )
        self.address = int(va.value)
        mapped = 0
        try:
            for fd, size in zip(fds, sizes, strict=True):
                handle = ctypes.c_ulonglong()
                _call(
                    lib,
                    "cuMemImportFromShareableHandle",
                    ctypes.byref(handle),
                    ctypes.c_void_p(fd),
                    _POSIX_FD,
                )
                try:
                    _call(
                        lib,
                        "cuMemMap",
                        ctypes.c_ulonglong(self.address + mapped),
                        ctypes.c_size_t(size),
                        ctypes.c_size_t(0),  # offset into the chunk: must be 0
                        handle,
                        ctypes.c_ulonglong(0),
                    )
                finally:
                    lib.cuMemRelease(handle)  # the mapping holds the memory now
                mapped += size
            access = _AccessDesc(_Location(_LOCATION_DEVICE, device), _READ_WRITE)
            _call(
                lib,
                "cuMemSetAccess",
                ctypes.c_ulonglong(self.address),
                ctypes.c_size_t(self.size),
                ctypes.byref(access),
                ctypes.c_size_t(1),
            )
        except BaseException:
            self._free(mapped)
            raise

    def _free(self, mapped: int) -> None:
        lib = _lib()
        if mapped:
            lib.cuMemUnmap(ctypes.c_ulonglong(self.address), ctypes.c_size_t(mapped))
        lib.cuMemAddressFree(ctypes.c_ulonglong(self.address), ctypes.c_size_t(self.size))

    def close(self) -> None:
        if self.size:
            with contextlib.suppress(ConfigError):
                self._free(self.size)
            self.size = 0
