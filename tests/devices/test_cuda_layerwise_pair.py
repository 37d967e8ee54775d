"""Issue 12's GPU done-when: two engine/sidecar pairs on one GPU. Each engine (in this process)
registers a CUDA KV cache that its sidecar process imports through IPC; prefill pushes layer by
layer over Mooncake TCP, gated on CUDA events that complete late, and decode's blocks end up
byte-exact. Skips without a CUDA GPU and the CUDA build of Mooncake.

How the events complete late: on a side stream the engine first runs a ~1 s GPU sleep, then
writes the layer's KV, then records the layer's ring slot. A sidecar that wrote before the
event completed would copy the blocks before the fill (zeros), so the byte-exact check fails;
and while the sleep runs, decode's blocks and prefill's byte counter must not move.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

import pytest

from app.sim.ranks import CacheParams
from app.transfer.wire.protocol import StepSlice
from tests.devices.harness import PAGE, require_device, require_device_mooncake, start_pair

pytestmark = pytest.mark.timeout(300)

PROMPT = 64
SLEEP_CYCLES = 2_000_000_000  # about a second on current GPUs


def test_layers_are_pushed_between_gpu_pairs_only_after_their_events(
    tmp_path: Path,
) -> None:
    require_device("cuda")
    require_device_mooncake()
    import torch

    params = CacheParams("llama-3.1-8b", 1, 16, 32, layers=2, events=True, device="cuda:0")
    sockets = Path(tempfile.mkdtemp(prefix="kvs-gputest-", dir="/dev/shm"))
    pair = start_pair(
        sockets, tmp_path, params, send_timeout_s=30, env={"KVSIDECAR_DEVICE_TYPE": "cuda"}
    )
    try:
        p, d = pair.p_layout, pair.d_layout
        assert p is not None and d is not None
        assert pair.p.ring is not None and pair.p.ring.spec.kind == "cuda"
        rid = "gpu-1"
        p_ids = torch.arange(1, 5)
        d_ids = torch.arange(9, 13)
        pair.d.expect_receive(rid, PROMPT, [d_ids.numpy()], prefill_tp=1)
        pair.send(rid, PROMPT, [p_ids.numpy()], [d_ids.numpy()])
        pair.p.begin_step(1, [StepSlice(rid, 0, PROMPT)])
        layers = sorted(p.placements)
        compute = torch.cuda.Stream()  # non-blocking: reading decode here does not wait on it
        t0 = time.monotonic()
        with torch.cuda.stream(compute):
            torch.cuda._sleep(SLEEP_CYCLES)
            for layer in layers:
                rows = p.buffers[p.placements[layer].buffer].view(p.num_blocks, -1)
                rows[p_ids.cuda()] = torch.randint(
                    0, 256, (len(p_ids), rows.shape[1]), dtype=torch.uint8, device="cuda"
                )
                pair.p.layer_ready(1, layer)  # records the ring slot on ``compute``
        assert time.monotonic() - t0 < 0.5, "layer_ready waited on the GPU"
        time.sleep(0.3)
        if not compute.query():  # the sleep still runs: nothing may have moved
            for layer in layers:
                rows = d.buffers[d.placements[layer].buffer].view(d.num_blocks, -1)
                assert not bool(rows[d_ids.cuda()].any()), f"layer {layer} written early"
            assert pair.poll(pair.p).bytes == 0
        compute.synchronize()
        assert pair.wait_end(pair.d, rid, 60) == "DONE"
        assert pair.wait_end(pair.p, rid, 60) == "DONE"
        for layer in layers:
            src = p.buffers[p.placements[layer].buffer].view(p.num_blocks, -1)[p_ids.cuda()]
            dst = d.buffers[d.placements[layer].buffer].view(d.num_blocks, -1)[d_ids.cuda()]
            assert torch.equal(src, dst), f"layer {layer} differs"
        assert pair.poll(pair.p).bytes == len(layers) * len(p_ids) * PAGE
    finally:
        pair.close()
        shutil.rmtree(sockets, ignore_errors=True)
