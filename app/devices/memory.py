"""Device KV memory shared between an engine and its sidecar (DESIGN §7).

- CPU: POSIX shared memory (``app.devices.shm``); nothing here.
- CUDA, ``cudaMalloc`` memory (PyTorch's default caching allocator): torch's IPC handles,
  ``storage._share_cuda_()`` in the engine and ``UntypedStorage._new_shared_cuda`` in the
  sidecar (``cudaIpcOpenMemHandle`` underneath), as ``torch.multiprocessing`` does, but with
  the handle's fields in a msgspec Struct instead of a pickle.
- CUDA, cuMem memory (expandable segments, vLLM sleep mode): per-chunk POSIX descriptors over a
  unix socket (``cumem``, ``fdpass``).
- NPU: torch_npu's IPC, ``storage._share_npu_()`` / ``UntypedStorage._new_shared_npu``, as
  vllm-ascend's own IPC helpers use it.

The sidecar must see the engine's device: same node, the device visible in its container. When
it does not, importing raises ``ConfigError`` saying what to change. torch.cuda, torch_npu and
libcuda are touched only when a device buffer is exported or imported.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from app.devices.base import backend
from app.devices.events import device_by_uuid
from app.devices.fdpass import FdServer, receive_fds
from app.devices.spec import CuMemBuffer, DeviceBuffer, TorchIpcBuffer
from app.errors import ConfigError

if TYPE_CHECKING:
    import torch

SOCKET_DIR = "/dev/shm"  # shared by engine and sidecar already (the KV segments live there)


@dataclass
class Exported:
    """An exported buffer as the engine keeps it: its wire description and, for cuMem
    memory, the server handing out its descriptors (close it after the sidecar is gone)."""

    buffer: DeviceBuffer
    server: FdServer | None = None

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None


@dataclass
class ImportedMemory:
    """An engine buffer mapped into the sidecar: ``tensor`` (uint8, on the device) views it;
    ``keep`` keeps the mapping alive (an IPC storage or a cuMem mapping)."""

    tensor: torch.Tensor
    keep: Any

    def close(self) -> None:
        """Unmap a cuMem mapping now (IPC storages go with their last reference)."""
        close = getattr(self.keep, "close", None)
        if close is not None:
            close()


def check_device_type(setting: str, rank: int, memory: Sequence[DeviceBuffer]) -> None:
    """The sidecar's ``device_type`` setting must allow the device the engine registered."""
    kinds = {getattr(b, "device_kind", "cuda") for b in memory}
    if setting != "auto" and kinds != {setting}:
        raise ConfigError(
            f"rank {rank} registered {'/'.join(sorted(kinds))} KV memory, but this sidecar "
            f"has device_type {setting}; set KVSIDECAR_DEVICE_TYPE to "
            f"{'/'.join(sorted(kinds))} or auto"
        )


def export_buffer(tensor: torch.Tensor, socket_dir: str = SOCKET_DIR) -> Exported:
    """Engine side: share a contiguous device tensor's bytes with another process."""
    kind = tensor.device.type
    if kind == "cpu":
        raise ConfigError("CPU KV memory is shared as POSIX shared memory, not exported")
    if not tensor.is_contiguous():
        raise ConfigError("only a contiguous KV buffer can be exported")
    index = tensor.device.index if tensor.device.index is not None else 0
    size = tensor.numel() * tensor.element_size()
    uuid = _uuid(kind, index)
    if kind == "cuda":
        from app.devices import cumem

        if cumem.is_cumem(tensor.data_ptr()):
            return _export_cumem(tensor.data_ptr(), size, index, uuid, socket_dir)
        shared = tensor.untyped_storage()._share_cuda_()
    elif kind == "npu":
        backend("npu")
        shared = tensor.untyped_storage()._share_npu_()  # type: ignore[attr-defined]
    else:
        raise ConfigError(f"KV on device {kind} cannot be shared; expected cpu, cuda or npu")
    if len(shared) != 8:
        raise ConfigError(
            f"storage._share_{kind}_() returned {len(shared)} fields, expected 8: a torch "
            f"{'or torch_npu ' if kind == 'npu' else ''}version this sidecar does not know"
        )
    _, handle, storage_size, storage_offset, rc_handle, rc_offset, ev_handle, ev_sync = shared
    return Exported(
        TorchIpcBuffer(
            device_kind=kind,
            device=index,
            device_uuid=uuid,
            size=size,
            offset=int(tensor.storage_offset()) * tensor.element_size(),
            handle=bytes(handle),
            storage_size=int(storage_size),
            storage_offset=int(storage_offset),
            ref_counter_handle=bytes(rc_handle or b""),
            ref_counter_offset=int(rc_offset or 0),
            event_handle=bytes(ev_handle or b""),
            event_sync_required=bool(ev_sync),
        )
    )


def _export_cumem(addr: int, size: int, index: int, uuid: str, socket_dir: str) -> Exported:
    from app.devices import cumem

    found = cumem.chunks(addr, size, index)
    fds = cumem.export_fds(found)
    token = secrets.token_bytes(32)
    path = os.path.join(socket_dir, f"kvs-fds-{secrets.token_hex(6)}.sock")
    try:
        server = FdServer(path, fds, token)
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    buf = CuMemBuffer(
        device=index,
        device_uuid=uuid,
        size=size,
        offset=found.offset,
        chunks=found.sizes,
        socket=path,
        token=token,
    )
    return Exported(buf, server)


def import_buffer(buf: DeviceBuffer) -> ImportedMemory:
    """Sidecar side: map an engine's exported buffer; ConfigError when this process cannot."""
    import torch  # a CPU-only sidecar never gets here and starts without it

    if isinstance(buf, CuMemBuffer):
        return _import_cumem(buf)
    kind = buf.device_kind
    index = device_by_uuid(kind, buf.device_uuid, buf.device)
    getattr(backend(kind), "init", lambda: None)()  # lazy device init before the import
    new_shared = getattr(torch.UntypedStorage, f"_new_shared_{kind}", None)
    if new_shared is None:
        raise ConfigError(f"this torch has no UntypedStorage._new_shared_{kind}: cannot import")
    try:
        storage = new_shared(
            index,
            buf.handle,
            buf.storage_size,
            buf.storage_offset,
            buf.ref_counter_handle,
            buf.ref_counter_offset,
            buf.event_handle or None,
            buf.event_sync_required,
        )
    except RuntimeError as e:
        raise ConfigError(
            f"opening the engine's {kind} memory failed ({e}); the sidecar must run on the "
            "engine's node with the device visible, and peer access allowed between the "
            "processes (no GPU isolation between the two containers)"
        ) from None
    if buf.offset + buf.size > storage.nbytes():
        raise ConfigError(
            f"the engine's {kind} storage has {storage.nbytes()} bytes, the buffer ends at "
            f"{buf.offset + buf.size}"
        )
    tensor = torch.empty(0, dtype=torch.uint8, device=f"{kind}:{index}").set_(storage)
    return ImportedMemory(tensor[buf.offset : buf.offset + buf.size], storage)


class _CudaArray:
    """``__cuda_array_interface__`` over a raw device range: torch views it without copying
    and keeps this object, and so ``keep``, alive with the tensor."""

    def __init__(self, address: int, size: int, keep: Any) -> None:
        self.keep = keep
        self.__cuda_array_interface__ = {
            "shape": (size,),
            "typestr": "|u1",
            "data": (address, False),
            "version": 3,
            "strides": None,
        }


def _import_cumem(buf: CuMemBuffer) -> ImportedMemory:
    import torch

    from app.devices import cumem

    index = device_by_uuid("cuda", buf.device_uuid, buf.device)
    # The driver calls below need this thread bound to the device's primary context.
    torch.cuda.set_device(index)
    torch.cuda.synchronize(index)
    fds = receive_fds(buf.socket, buf.token, len(buf.chunks))
    try:
        mapping = cumem.Mapping(fds, buf.chunks, index)
    finally:
        for fd in fds:
            os.close(fd)
    if buf.offset + buf.size > mapping.size:
        mapping.close()
        raise ConfigError(
            f"the engine's cuMem chunks hold {mapping.size} bytes, the buffer ends at "
            f"{buf.offset + buf.size}"
        )
    array = _CudaArray(mapping.address + buf.offset, buf.size, mapping)
    return ImportedMemory(torch.as_tensor(array, device=f"cuda:{index}"), mapping)


def _uuid(kind: str, index: int) -> str:
    props = backend(kind).get_device_properties(index)
    return str(getattr(props, "uuid", "") or "")


@dataclass
class DeviceArena:
    """Device KV buffers of one engine rank; ``allocator`` plugs into ``layout.allocate``."""

    device: str  # e.g. "cuda:0"
    buffers: list[torch.Tensor] = field(default_factory=list)
    exported: list[Exported] = field(default_factory=list)

    def allocator(self, nbytes: int) -> torch.Tensor:
        import torch

        tensor = torch.zeros(nbytes, dtype=torch.uint8, device=self.device)
        self.buffers.append(tensor)
        return tensor

    def export(self) -> list[DeviceBuffer]:
        """Wire descriptions of every buffer, exported once."""
        if not self.exported:
            self.exported = [export_buffer(b) for b in self.buffers]
        return [e.buffer for e in self.exported]

    def close(self) -> None:
        for e in self.exported:
            e.close()
        self.exported = []
