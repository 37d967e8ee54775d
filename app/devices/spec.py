"""What the device layer puts on the wire: msgspec Structs only (IPC handles are bytes fields,
never pickles), bounded like the rest of the protocol so that a bad value is a ProtocolError
naming the field. Nothing here imports torch.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

_BIG = 1 << 48  # bytes: more than any device or host holds
Bytes = Annotated[int, msgspec.Meta(ge=0, le=_BIG)]
DeviceIndex = Annotated[int, msgspec.Meta(ge=0, le=1024)]
Uuid = Annotated[str, msgspec.Meta(max_length=64)]
# A /dev/shm file name or a unix socket path: no path tricks in the names the sidecar opens.
ShmName = Annotated[str, msgspec.Meta(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9._-]+$")]
SocketPath = Annotated[
    str, msgspec.Meta(min_length=1, max_length=107, pattern=r"^/[A-Za-z0-9._/-]+$")
]
Handle = Annotated[bytes, msgspec.Meta(max_length=256)]  # cudaIpc*Handle_t is 64 bytes


class FdSource(msgspec.Struct, frozen=True, kw_only=True):
    """Descriptors an engine serves on a unix socket (``app.devices.fdpass``), in order, to a
    client that sends ``token`` first."""

    socket: SocketPath
    token: Annotated[bytes, msgspec.Meta(min_length=16, max_length=64)]


RING_KINDS = ("shm", "cuda", "npu")
MAX_RING_LAYERS = 4096
MAX_RING_SLOTS = 64


class EventRingSpec(msgspec.Struct, frozen=True, kw_only=True):
    """An engine rank's event ring, as its registration carries it (``app.devices.events``).

    ``kind``: ``shm`` (completion marked in the state table by a waiter thread inside the
    engine: CPU, and NPU without interprocess events) or ``cuda`` / ``npu`` (one interprocess
    event per layer and slot, ``handles`` in layer-major order). ``table`` is the shared-memory
    file of the sequence numbers.
    """

    kind: Annotated[str, msgspec.Meta(pattern="^(shm|cuda|npu)$")]
    layers: Annotated[int, msgspec.Meta(ge=1, le=MAX_RING_LAYERS)]
    slots: Annotated[int, msgspec.Meta(ge=1, le=MAX_RING_SLOTS)]
    table: ShmName
    device: DeviceIndex = 0
    device_uuid: Uuid = ""
    handles: Annotated[tuple[Handle, ...], msgspec.Meta(max_length=1 << 16)] = ()

    def __post_init__(self) -> None:
        want = 0 if self.kind == "shm" else self.layers * self.slots
        if len(self.handles) != want:
            # Raised inside decoding: msgspec turns it into a ValidationError on this struct.
            raise ValueError(
                f"an event ring of kind {self.kind} with {self.layers} layers x {self.slots} "
                f"slots carries {want} event handles, not {len(self.handles)}"
            )


class TorchIpcBuffer(msgspec.Struct, frozen=True, kw_only=True, tag="torch_ipc"):
    """A device storage shared with torch's IPC (``_share_cuda_`` / torch_npu's
    ``_share_npu_``): the fields of that tuple, plus where the KV buffer sits in the storage."""

    device_kind: Annotated[str, msgspec.Meta(pattern="^(cuda|npu)$")]
    device: DeviceIndex
    device_uuid: Uuid = ""
    size: Bytes  # the KV buffer's bytes
    offset: Bytes = 0  # from the storage's first byte to the buffer's
    handle: Handle
    storage_size: Bytes
    storage_offset: Bytes  # the storage's offset inside the IPC allocation
    ref_counter_handle: Handle = b""
    ref_counter_offset: Bytes = 0
    event_handle: Handle = b""
    event_sync_required: bool = False


class CuMemBuffer(msgspec.Struct, frozen=True, kw_only=True, tag="cuda_cumem"):
    """A cuMem-based (virtual memory management) allocation: its physical chunks, exported as
    POSIX file descriptors that the engine hands out over a unix socket (SCM_RIGHTS)."""

    device: DeviceIndex
    device_uuid: Uuid = ""
    size: Bytes
    offset: Bytes  # from the first chunk's first byte to the buffer's
    chunks: Annotated[tuple[Bytes, ...], msgspec.Meta(min_length=1, max_length=1 << 16)]
    socket: SocketPath
    token: Annotated[bytes, msgspec.Meta(min_length=16, max_length=64)]


DeviceBuffer = TorchIpcBuffer | CuMemBuffer
