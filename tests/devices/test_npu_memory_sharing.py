"""NPU KV memory exported by an engine process through torch_npu's IPC and imported here, as
the sidecar does (``test_cuda_memory_sharing``'s round trip). Skips without torch_npu and an
NPU."""

from __future__ import annotations

import pytest

from tests.devices.harness import require_device
from tests.devices.test_cuda_memory_sharing import roundtrip

pytestmark = pytest.mark.timeout(120)


def test_torch_npu_ipc_shares_the_cache() -> None:
    require_device("npu")
    roundtrip("npu", {}, "TorchIpcBuffer")
