"""Without the engine's device (this machine has no GPU, torch is a CPU build) every device
path refuses with a sentence that says what to change, and a registration carrying device
memory is refused by a real sidecar without side effects."""

from __future__ import annotations

import msgspec
import pytest
import torch

from app.devices import Device
from app.devices.events import EngineRing, SidecarRing
from app.devices.memory import check_device_type, export_buffer, import_buffer
from app.devices.spec import EventRingSpec, TorchIpcBuffer
from app.engine_link.sync_client import SyncClient
from app.errors import ConfigError
from app.kvcache.engine_spec import (
    Axis,
    EngineGroup,
    EngineLayer,
    EngineRegistration,
    MemorySpan,
)
from app.kvcache.preset_registration import preset_registration
from app.transfer.wire.protocol import RegisterEngine, Reply
from tests.devices.harness import Pair

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks the refusals of a machine without CUDA"
)

CUDA_BUFFER = TorchIpcBuffer(
    device_kind="cuda",
    device=0,
    device_uuid="GPU-00000000-0000-0000-0000-000000000000",
    size=1 << 20,
    handle=b"h" * 64,
    storage_size=1 << 20,
    storage_offset=0,
)
SEES_NO_CUDA = "this sidecar sees no cuda device"


def test_importing_cuda_memory_says_what_to_change() -> None:
    with pytest.raises(ConfigError, match=SEES_NO_CUDA) as e:
        import_buffer(CUDA_BUFFER)
    assert "same devices visible" in str(e.value)


def test_opening_cuda_events_says_what_to_change() -> None:
    spec = EventRingSpec(kind="cuda", layers=1, slots=1, table="kvs-none", handles=(b"h" * 64,))
    with pytest.raises(ConfigError, match=SEES_NO_CUDA):
        SidecarRing.open(spec)


def test_the_engine_side_needs_the_device_too() -> None:
    with pytest.raises(ConfigError, match="needs a visible cuda device"):
        EngineRing.create(1, device="cuda")
    with pytest.raises(ConfigError, match="POSIX shared memory"):
        export_buffer(torch.zeros(8, dtype=torch.uint8))
    assert Device.resolve("auto").kind == "cpu"


def test_device_type_must_allow_the_registered_memory() -> None:
    with pytest.raises(ConfigError, match="set KVSIDECAR_DEVICE_TYPE to cuda or auto"):
        check_device_type("cpu", 0, [CUDA_BUFFER])
    check_device_type("auto", 0, [CUDA_BUFFER])
    check_device_type("cuda", 0, [CUDA_BUFFER])


def test_a_real_sidecar_refuses_device_memory_it_cannot_see(pair: Pair) -> None:
    """The simulated engine's registration of the same cache on a device: refused, and the
    rank already registered keeps its memory and epoch."""
    before = pair.p.sidecar_info()
    sizes = [int(b.numel()) for b in pair.p_layout.buffers]
    buffers = [msgspec.structs.replace(CUDA_BUFFER, size=n, storage_size=n) for n in sizes]
    reg = preset_registration(
        pair.p_layout,
        engine_id="probe",
        memory=[MemorySpan(f"cuda:0-{i}", 0, n) for i, n in enumerate(sizes)],
        device_memory=buffers,
    )
    client = SyncClient(pair.prefill.ipc)
    try:
        reply = client.request(RegisterEngine(registration=reg), 30)
    finally:
        client.close()
    assert isinstance(reply, Reply) and not reply.ok
    assert reply.error is not None and SEES_NO_CUDA in reply.error
    after = pair.p.sidecar_info()
    assert after["ready"] is True and after["epoch"] == before["epoch"], (before, after)


def test_a_real_sidecar_refuses_an_engine_registration_on_a_device_it_cannot_see(
    pair: Pair,
) -> None:
    """The connector's path (vLLM's own tensors): the refusal comes before anything changes,
    even for the rank already registered (no new generation, the same epoch)."""
    before = pair.p.sidecar_info()
    reg = EngineRegistration(
        engine_id="probe",
        rank=0,
        tp_size=1,
        model="probe",
        engine_version="0",
        num_blocks=8,
        groups=[EngineGroup("full", 16, 16, ["l0"])],
        layers=[
            EngineLayer(
                "l0",
                0,
                0,
                0,
                "bfloat16",
                [Axis("block", 8, 4096), Axis("head", 1, 2048), Axis("token", 16, 128)],
                64,
                64,
                1,
            )
        ],
        memory=[MemorySpan("cuda:0-0", 0, 1 << 20)],
        device_memory=[CUDA_BUFFER],
    )
    client = SyncClient(pair.prefill.ipc)
    try:
        reply = client.request(RegisterEngine(registration=reg), 30)
    finally:
        client.close()
    assert isinstance(reply, Reply) and not reply.ok
    assert reply.error is not None and SEES_NO_CUDA in reply.error
    after = pair.p.sidecar_info()
    assert after["ready"] is True and after["epoch"] == before["epoch"], (before, after)
