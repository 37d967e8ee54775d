"""The event ring and device buffers on the wire: msgspec only, bounded, with defaults that
keep today's messages meaning what they meant."""

from __future__ import annotations

import msgspec
import pytest
import torch

from app.devices.spec import CuMemBuffer, EventRingSpec, TorchIpcBuffer
from app.errors import ProtocolError
from app.kvcache.engine_spec import EngineRegistration
from app.kvcache.groups import build_cache_config
from app.kvcache.layout import allocate
from app.kvcache.preset_registration import preset_registration
from app.kvcache.presets import load_preset
from app.transfer.wire.codec import decode, encode
from app.transfer.wire.protocol import PROTOCOL_VERSION, LayerReady, RegisterEngine


def _register(**kw: object) -> RegisterEngine:
    """The simulated engine's registration of a two-layer Llama (one shm file per layer)."""
    cfg = build_cache_config(load_preset("llama-3.1-8b", layers=2), 1, 16, num_blocks=8)
    layout = allocate(cfg, 0, allocator=lambda n: torch.empty(n, dtype=torch.uint8))
    reg = preset_registration(layout, engine_id="e")
    return RegisterEngine(registration=msgspec.structs.replace(reg, **kw))


def test_a_layer_ready_without_a_slot_means_no_event() -> None:
    old = msgspec.msgpack.encode(
        {"type": "layer_ready", "version": PROTOCOL_VERSION, "rank": 0, "step": 3, "layer": 1}
    )
    msg = decode(old)
    assert isinstance(msg, LayerReady) and (msg.slot, msg.seq) == (-1, 0)
    assert decode(encode(LayerReady(rank=0, step=3, layer=1, slot=2, seq=7))) == LayerReady(
        rank=0, step=3, layer=1, slot=2, seq=7
    )


@pytest.mark.parametrize(("field", "value"), [("slot", -2), ("slot", 64), ("seq", -1)])
def test_layer_ready_bounds(field: str, value: int) -> None:
    frame = msgspec.msgpack.encode(
        {
            "type": "layer_ready",
            "version": PROTOCOL_VERSION,
            "rank": 0,
            "step": 0,
            "layer": 0,
            field: value,
        }
    )
    with pytest.raises(ProtocolError, match=field):
        decode(frame)


def test_registrations_carry_an_optional_ring_and_device_buffers() -> None:
    plain = _register().registration
    assert plain.events is None and plain.device_memory is None
    defaults = {f.name: f.default for f in msgspec.structs.fields(EngineRegistration)}
    assert defaults["events"] is None
    ring = EventRingSpec(kind="cuda", layers=1, slots=2, table="t", handles=(b"a" * 64, b"b" * 64))
    bufs = [
        TorchIpcBuffer(
            device_kind="cuda",
            device=0,
            size=10,
            handle=b"h" * 64,
            storage_size=16,
            storage_offset=0,
        ),
        CuMemBuffer(
            device=0,
            size=10,
            offset=0,
            chunks=(1 << 21,),
            socket="/dev/shm/x.sock",
            token=b"t" * 32,
        ),
    ]
    msg = _register(events=ring, device_memory=bufs)
    assert decode(encode(msg)) == msg


def test_a_ring_with_the_wrong_number_of_handles_is_a_protocol_error() -> None:
    raw = msgspec.to_builtins(_register())
    raw["registration"]["events"] = {
        "kind": "cuda",
        "layers": 2,
        "slots": 2,
        "table": "t",
        "handles": [],
    }
    bad = msgspec.msgpack.encode(raw)
    with pytest.raises(ProtocolError, match="carries 4 event handles, not 0"):
        decode(bad)


@pytest.mark.parametrize("table", ["../etc/passwd", "a/b", ""])
def test_ring_table_names_are_plain_file_names(table: str) -> None:
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"kind": "shm", "layers": 1, "slots": 1, "table": table}, EventRingSpec)
