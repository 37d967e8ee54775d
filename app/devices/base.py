"""Devices behind one small interface (DESIGN §7): current device, stream, event.

CPU events are complete when recorded. CUDA and NPU come from torch / torch_npu, imported lazily
so the project imports, tests and demos without them.
"""

from __future__ import annotations

from typing import Any, Protocol

from app.errors import ConfigError

KINDS = ("cpu", "cuda", "npu")


class Event(Protocol):
    def record(self) -> None: ...

    def synchronize(self) -> None: ...

    def query(self) -> bool: ...


class CpuEvent:
    """The KV write already happened when a CPU engine signals a layer."""

    def record(self) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


def backend(kind: str) -> Any:
    """``torch.cuda`` or ``torch.npu`` (importing torch_npu registers the latter)."""
    import torch

    if kind == "cuda":
        return torch.cuda
    if kind == "npu":
        try:
            import torch_npu  # noqa: F401
        except ImportError:
            raise ConfigError(
                "device kind npu needs torch_npu; install the npu extra (pip install "
                "'kv-sidecar[npu]') matching the CANN version of the host"
            ) from None
        return torch.npu  # type: ignore[attr-defined]
    raise ConfigError(f"device kind must be cuda or npu here, not {kind!r}")


def available(kind: str) -> bool:
    """Whether this process sees a device of ``kind`` (never raises, never initialises more
    than torch itself does on ``is_available``)."""
    if kind == "cpu":
        return True
    try:
        return bool(backend(kind).is_available())
    except (ConfigError, ImportError, RuntimeError):
        return False


class Device:
    def __init__(self, kind: str = "cpu", index: int = 0) -> None:
        if kind not in KINDS:
            raise ValueError(f"device kind must be cpu, cuda or npu, not {kind!r}")
        self.kind = kind
        self.index = index

    @classmethod
    def resolve(cls, setting: str = "auto") -> Device:
        """The device a ``device_type`` setting names; ``auto`` picks npu, then cuda, then cpu."""
        if setting == "auto":
            kind = next((k for k in ("npu", "cuda") if available(k)), "cpu")
        elif setting in KINDS:
            kind = setting
        else:
            raise ConfigError(f"device_type must be auto, cpu, cuda or npu, not {setting!r}")
        index = 0 if kind == "cpu" else int(backend(kind).current_device())
        return cls(kind, index)

    def _backend(self) -> Any:
        return backend(self.kind)

    def event(self) -> Event:
        """A new event recorded on the current stream."""
        if self.kind == "cpu":
            return CpuEvent()
        ev: Event = self._backend().Event()
        ev.record()
        return ev

    def __repr__(self) -> str:
        return f"Device({self.kind}:{self.index})"
