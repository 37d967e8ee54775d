"""The KV digest over device memory (issue 51): the same two words per run as
``digest.digest_runs`` (wrapped lane sum, wrapped index-weighted lane sum), computed with torch
ops where the KV lives (CUDA, NPU), with no kernel of our own.

Torch has no unsigned 64-bit arithmetic on devices, but two's-complement int64 sums and products
wrap exactly as uint64 ones do modulo 2**64, so the words are bit-equal to numpy's. Runs of one
length at lane-aligned offsets are digested together (gathered, then two reductions: a few kernel
launches per batch, not per run); any other run alone, through an aligned, zero-padded copy.
Only the two words per run come back to the host.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from app.kvcache.digest import locate

if TYPE_CHECKING:
    import torch

_LANE = 8
_BATCH_BYTES = 64 << 20  # gathered at once: bounds the copy a batch makes on the device


@dataclass(frozen=True)
class TensorMemory:
    """Spans ``(address, tensor)`` of an engine's KV mapped in this process: each a 1-D uint8
    torch tensor (on its device) whose first byte is at ``address``. An address outside them is
    an error, never a read (``digest.locate``)."""

    spans: tuple[tuple[int, Any], ...]
    _weights: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def _lane_weights(self, like: torch.Tensor, n: int) -> torch.Tensor:
        import torch

        key = str(like.device)
        w = self._weights.get(key)
        if w is None or w.numel() < n:
            w = torch.arange(1, 1 + max(n, 1 << 16), dtype=torch.int64, device=like.device)
            self._weights[key] = w
        return w[:n]

    def digest(self, addrs: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """Two 64-bit words per run (shape ``(n, 2)``, uint64), equal to ``digest_runs``'."""
        import torch

        n = int(addrs.size)
        out = np.zeros((n, 2), np.uint64)
        bounds = [(base, int(tensor.numel())) for base, tensor in self.spans]
        batches: dict[tuple[int, int], list[tuple[int, int]]] = defaultdict(list)
        parts: list[tuple[list[int], torch.Tensor]] = []
        for i, (addr, length) in enumerate(zip(addrs.tolist(), lengths.tolist(), strict=True)):
            span, off = locate(bounds, int(addr), int(length))
            tensor = self.spans[span][1]
            if length % _LANE == 0 and (int(tensor.data_ptr()) + off) % _LANE == 0:
                batches[(span, length // _LANE)].append((i, off))
            else:
                parts.append(([i], self._words(self._padded(tensor[off : off + length]))))
        for (span, lanes), runs in batches.items():
            tensor = self.spans[span][1]
            per_batch = max(1, _BATCH_BYTES // (lanes * _LANE))
            for k in range(0, len(runs), per_batch):
                chunk = runs[k : k + per_batch]
                gathered = torch.stack(
                    [tensor[off : off + lanes * _LANE].view(torch.int64) for _, off in chunk]
                )
                parts.append(([i for i, _ in chunk], self._words(gathered)))
        for which, words in parts:
            out[which] = words.cpu().numpy().view(np.uint64)
        return out

    @staticmethod
    def _padded(run: torch.Tensor) -> torch.Tensor:
        """A run as one row of lanes: copied to a fresh (aligned) buffer, tail zero-padded."""
        import torch

        pad = (-int(run.numel())) % _LANE
        return torch.cat([run, run.new_zeros(pad)]).view(torch.int64).reshape(1, -1)

    def _words(self, rows: torch.Tensor) -> torch.Tensor:
        """``(rows, 2)`` int64: each row's wrapped sum and wrapped index-weighted sum."""
        import torch

        w = self._lane_weights(rows, int(rows.shape[1]))
        return torch.stack([rows.sum(dim=1), (rows * w).sum(dim=1)], dim=1)
