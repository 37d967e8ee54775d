"""An engine process holding device KV memory, for the GPU / NPU tests: allocates a buffer on
``--device`` (cuda or npu), fills it with a pattern, exports it and prints the wire description
as JSON; then ``read`` prints the buffer's first bytes, anything else ends it."""

from __future__ import annotations

import argparse
import sys

import msgspec
import torch

from app.devices.base import backend
from app.devices.memory import export_buffer

SIZE = 8 << 20


def pattern(device: str) -> torch.Tensor:
    return (torch.arange(SIZE, dtype=torch.int64, device=device) % 251).to(torch.uint8)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", choices=["cuda", "npu"], required=True)
    args = ap.parse_args()
    be = backend(args.device)
    buf = torch.empty(SIZE, dtype=torch.uint8, device=f"{args.device}:0")
    buf.copy_(pattern(f"{args.device}:0"))
    be.synchronize()
    exported = export_buffer(buf)
    print(msgspec.json.encode(exported.buffer).decode(), flush=True)
    for line in sys.stdin:
        if line.strip() != "read":
            break
        be.synchronize()
        print(" ".join(str(int(x)) for x in buf[:8].cpu()), flush=True)
    exported.close()


if __name__ == "__main__":
    main()
