"""Issue 51's digest on each kind of KV memory: a real sidecar pair over Mooncake TCP, every
request digested. On ``cpu`` the engines' KV is shared memory and the sidecars digest it with
numpy; on ``cuda`` it is GPU memory the sidecars import, digested with torch ops on the GPU
(``kvcache.tensor_digest``). A clean push is checked and DONE; a push whose first layer the
engine overwrote after it was sent (a late write) is caught at decode and fails there, naming
the layer. The cuda case skips without a GPU and the CUDA build of Mooncake."""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

import pytest

from app.ports import read_port_file
from app.sim.ranks import CacheParams
from app.transfer.wire.protocol import StepSlice
from tests.conftest import digested_bytes
from tests.devices.harness import (
    PAGE,
    Pair,
    Side,
    require_device,
    require_device_mooncake,
    start_pair,
)

pytestmark = pytest.mark.timeout(300)

PROMPT = 64


def _digested(side: Side) -> dict[str, float]:
    ports = read_port_file(side.port_file) if side.port_file else None
    assert ports is not None
    return digested_bytes(f"http://127.0.0.1:{ports['admin_port']}")


def _push(pair: Pair, rid: str, step: int, device: str, *, late_write: bool) -> object:
    """Fill prefill's blocks of each layer and mark it ready; with ``late_write`` the first
    layer's first block changes once it has been written to decode. Decode's end."""
    import torch

    p = pair.p_layout
    p_ids, d_ids = torch.arange(1, 5), torch.arange(9, 13)
    pair.d.expect_receive(rid, PROMPT, [d_ids.numpy()], prefill_tp=1)
    pair.send(rid, PROMPT, [p_ids.numpy()], [d_ids.numpy()])
    pair.p.begin_step(step, [StepSlice(rid, 0, PROMPT)])
    sent_before = pair.poll(pair.p).bytes
    for k, layer in enumerate(sorted(p.placements)):
        rows = p.buffers[p.placements[layer].buffer].view(p.num_blocks, -1)
        rows[p_ids.to(device)] = torch.randint(
            0, 256, (len(p_ids), rows.shape[1]), dtype=torch.uint8, device=device
        )
        if device != "cpu":
            torch.cuda.synchronize()
        pair.p.layer_ready(step, layer)
        if late_write and k == 0:
            deadline = time.monotonic() + 10
            while pair.poll(pair.p).bytes < sent_before + len(p_ids) * PAGE:
                assert time.monotonic() < deadline, "layer 0 was not written within 10 s"
                time.sleep(0.05)
            rows[int(p_ids[0])][0] ^= 0x40  # the engine writes the block after it was sent
            if device != "cpu":
                torch.cuda.synchronize()
    return pair.wait_end(pair.d, rid, 60)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_late_write_is_caught_on_each_memory_kind(tmp_path: Path, device: str) -> None:
    if device != "cpu":
        require_device(device)
        require_device_mooncake()
    params = CacheParams(
        "llama-3.1-8b", 1, 16, 32, layers=2, device="cuda:0" if device == "cuda" else "cpu"
    )
    sockets = Path(tempfile.mkdtemp(prefix="kvs-digest-", dir="/dev/shm"))
    env = {"KVSIDECAR_KV_DIGEST__SHARE": "1"}
    if device != "cpu":
        env["KVSIDECAR_DEVICE_TYPE"] = device
    pair = start_pair(sockets, tmp_path, params, send_timeout_s=30, env=env)
    try:
        assert _push(pair, "clean", 1, device, late_write=False) == "DONE"
        assert pair.wait_end(pair.p, "clean", 60) == "DONE"
        one = 2 * 4 * PAGE  # two layers of four blocks
        assert _digested(pair.prefill)["prefill"] == one
        assert _digested(pair.decode)["decode"] == one

        ended = _push(pair, "late", 2, device, late_write=True)
        assert not isinstance(ended, str), "decode took KV that differs from prefill's"
        assert ended.error.startswith("KV digest mismatch"), ended.error
        assert "layer 0" in ended.error and "block 9 " in ended.error, ended.error
    finally:
        pair.close()
        shutil.rmtree(sockets, ignore_errors=True)
