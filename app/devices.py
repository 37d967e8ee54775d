"""Devices behind one small interface (DESIGN §7): current device, stream, event.

CPU events are complete when recorded. CUDA and NPU come from torch / torch_npu, imported lazily
so the project imports, tests and demos without them.
"""

from __future__ import annotations

from typing import Any, Protocol


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


class Device:
    def __init__(self, kind: str = "cpu", index: int = 0) -> None:
        if kind not in ("cpu", "cuda", "npu"):
            raise ValueError(f"device kind must be cpu, cuda or npu, not {kind!r}")
        self.kind = kind
        self.index = index

    def _backend(self) -> Any:
        import torch

        if self.kind == "cuda":
            return torch.cuda
        import torch_npu  # noqa: F401  (registers torch.npu)

        return torch.npu  # type: ignore[attr-defined]

    def event(self) -> Event:
        """A new event recorded on the current stream."""
        if self.kind == "cpu":
            return CpuEvent()
        ev: Event = self._backend().Event()
        ev.record()
        return ev

    def __repr__(self) -> str:
        return f"Device({self.kind}:{self.index})"
