"""Micro-benchmark of the KV digest (issue 51): ms and CPU seconds per GB, by run length.

Run lengths stand for the group kinds: a full-attention or MLA block run (whole blocks, long
coalesced runs), a TP head slice (one block's slice), a sliding window's tail (a few blocks), a
GDN/Mamba state slice. ``python -m app.bench.digest [--out FILE.json]``: the JSON carries the
host it ran on (``result_file.write_result``).

``--device cuda`` (or ``npu``, ``cpu``) measures the device path instead: the same runs in a
torch tensor there, digested by ``TensorMemory`` (torch ops; the device synchronized before the
clock stops, since only the words come back). CPU seconds are then the host thread's: launches
and the copy of the words, not the device's work."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from app.bench.core.host import NO_LINK, host_record
from app.bench.core.result_file import write_result
from app.kvcache.digest import HostMemory, KvMemory
from app.kvcache.tensor_digest import TensorMemory

# kind -> bytes per descriptor (bf16, 8 KV heads x 128 dims x 16 tokens = 32 KiB a block)
KINDS = {
    "full/mla (64-block runs)": 64 * 32768,
    "block (32 KiB)": 32768,
    "tp slice (8 KiB)": 8192,
    "gdn state slice (2 KiB)": 2048,
}


def _memory(total: int, device: str | None) -> tuple[int, KvMemory, object]:
    """Random bytes (on ``device`` as a torch tensor, else a numpy array): their first
    address, the digest's view of them, and the buffer to keep alive."""
    buf = np.random.default_rng(0).integers(0, 256, total, dtype=np.uint8)
    if device is None:
        return buf.ctypes.data, HostMemory(((buf.ctypes.data, buf.nbytes),)), buf
    import torch

    tensor = torch.from_numpy(buf).to(device)
    base = int(tensor.data_ptr())
    return base, TensorMemory(((base, tensor),)), tensor


def measure(
    run_bytes: int, total: int = 256 << 20, repeat: int = 3, device: str | None = None
) -> tuple[float, float]:
    """(wall ms per GB, CPU s per GB) digesting ``total`` bytes in runs of ``run_bytes``, with
    numpy over host memory or (``device``) torch ops on a tensor there."""
    base, mem, _keep = _memory(total, device)
    n = total // run_bytes
    addrs = base + np.arange(n, dtype=np.int64) * run_bytes
    lens = np.full(n, run_bytes, np.int64)
    best_wall, best_cpu = float("inf"), float("inf")
    for _ in range(repeat):
        w0, c0 = time.perf_counter(), time.process_time()
        mem.digest(addrs, lens)
        best_wall = min(best_wall, time.perf_counter() - w0)
        best_cpu = min(best_cpu, time.process_time() - c0)
    gb = n * run_bytes / 1e9
    return best_wall * 1e3 / gb, best_cpu / gb


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m app.bench.digest", description=__doc__)
    ap.add_argument("--out", type=Path, help="the figures as JSON, with the host record")
    ap.add_argument("--mib", type=int, default=256, help="bytes digested per kind and repeat")
    ap.add_argument("--device", help="torch device for the device path (cuda, npu, cpu)")
    a = ap.parse_args(argv)
    print(f"{'kind':28} {'ms/GB':>8} {'CPU s/GB':>9}  ({a.device or 'numpy, host memory'})")
    rows = []
    for kind, size in KINDS.items():
        wall, cpu = measure(size, total=a.mib << 20, device=a.device)
        print(f"{kind:28} {wall:8.1f} {cpu:9.3f}")
        rows.append({"kind": kind, "run_bytes": size, "ms_per_gb": wall, "cpu_s_per_gb": cpu})
    if a.out is not None:
        result = {"bench": "digest", "path": a.device or "numpy", "rows": rows}
        write_result(a.out, result, host_record(engines={}, link=NO_LINK))


if __name__ == "__main__":
    main()
