"""CUDA KV memory exported by an engine process and imported here, as the sidecar does: with
CUDA IPC handles (cudaMalloc memory) and with cuMem descriptors (expandable segments). Both
processes see the same bytes, both ways. Skips without a CUDA GPU."""

from __future__ import annotations

import os
import select
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from tests.devices.harness import require_device

pytestmark = pytest.mark.timeout(120)

SCRIPT = Path(__file__).with_name("_device_engine.py")
ROOT = Path(__file__).parents[2]


def roundtrip(device: str, env: dict[str, str], want_kind: str) -> None:
    """Shared by the CUDA and NPU tests."""
    import torch

    from app.devices.memory import import_buffer
    from app.devices.spec import DeviceBuffer

    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), "--device", device],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**os.environ, **env},
    )
    assert proc.stdin is not None and proc.stdout is not None
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 60)
        assert ready, "the engine process exported nothing within 60 s"
        buf = msgspec.json.decode(proc.stdout.readline(), type=DeviceBuffer)
        assert type(buf).__name__ == want_kind, buf
        mem = import_buffer(buf)
        want = (torch.arange(buf.size, dtype=torch.int64) % 251).to(torch.uint8)
        assert torch.equal(mem.tensor.cpu(), want), "imported bytes differ from the engine's"
        mem.tensor[:8] = 7  # and the engine sees what the sidecar writes
        getattr(torch, device).synchronize()
        proc.stdin.write("read\n")
        proc.stdin.flush()
        assert proc.stdout.readline().split() == ["7"] * 8
        mem.close()
    finally:
        proc.stdin.close()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def test_cuda_ipc_handles_share_the_cache() -> None:
    require_device("cuda")
    roundtrip("cuda", {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}, "TorchIpcBuffer")


def test_cumem_descriptors_share_an_expandable_segment_cache() -> None:
    require_device("cuda")
    roundtrip("cuda", {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, "CuMemBuffer")
