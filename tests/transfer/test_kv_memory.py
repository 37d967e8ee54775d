"""The memory a registered engine's digest reads (issue 51): its spans start ``offset`` bytes
into each buffer, whether the buffer is mapped pages (numpy) or a device tensor (torch ops, here
on CPU tensors); both kinds read the same bytes and give the same words."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from app.errors import OutOfBoundsError
from app.kvcache.digest import HostMemory
from app.kvcache.engine_spec import MemorySpan
from app.kvcache.tensor_digest import TensorMemory
from app.transfer.requests.integrity import kv_memory


def test_both_kinds_read_the_registered_spans_alike() -> None:
    g = torch.Generator().manual_seed(4)
    buffers = [torch.randint(0, 256, (4096,), dtype=torch.uint8, generator=g) for _ in range(2)]
    registered = [MemorySpan("a", 256, 2048), MemorySpan("b", 1024, 3072)]
    # As the registry computes them: each span's address in this process and its size.
    spans = [
        (int(b.data_ptr()) + s.offset, s.size) for b, s in zip(buffers, registered, strict=True)
    ]
    host = kv_memory(spans)
    dev = kv_memory(spans, buffers)
    assert isinstance(host, HostMemory) and isinstance(dev, TensorMemory)
    starts = [a for a, _ in spans]
    addrs = np.array([starts[0], starts[0] + 2048 - 64, starts[1] + 5, starts[1] + 3072 - 8])
    lens = np.array([64, 64, 999, 8])
    words = host.digest(addrs, lens)
    assert (dev.digest(addrs, lens) == words).all()
    # The first span's first byte is byte 256 of its buffer: a change there is seen...
    buffers[0][256] ^= 1
    assert (host.digest(addrs[:1], lens[:1]) != words[:1]).any()
    assert (dev.digest(addrs[:1], lens[:1]) != words[:1]).any()
    # ...and the bytes before it are outside what the engine registered: never read.
    for mem in (host, dev):
        with pytest.raises(OutOfBoundsError):
            mem.digest(np.array([starts[0] - 8]), np.array([8]))
        with pytest.raises(OutOfBoundsError):
            mem.digest(np.array([starts[1] + 3072 - 4]), np.array([8]))
