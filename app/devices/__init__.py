"""Devices (DESIGN §7): events, the per-layer event ring shared with the sidecar, and device
KV memory shared across processes. Device-specific code (torch.cuda, torch_npu, libcuda) is
imported lazily: this package imports and its CPU paths run on a machine without either.

- ``base``: the ``Event`` protocol, ``CpuEvent``, ``Device``.
- ``spec``: what goes on the wire (msgspec only): ``EventRingSpec``, ``DeviceBuffer``.
- ``events``: the event ring (engine side ``EngineRing``, sidecar side ``SidecarRing``).
- ``memory``: export / import of device KV storage (CUDA IPC, cuMem fds, torch_npu IPC).
"""

from app.devices.base import CpuEvent, Device, Event

__all__ = ["CpuEvent", "Device", "Event"]
