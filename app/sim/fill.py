"""The deterministic KV fill: every element's bits are a hash of its *global* coordinates.

(request, layer, stream, token position, global head or channel group, element) → bits. A byte
that lands in the wrong request's blocks (even at the same positions), block, head, row, layer
or stream, or a state computed for the wrong number of tokens, reads back as a different
value. P writes it through its own views; D's oracle expects it through D's views, knowing
nothing of the planner. Pool requests (token ids given) use salt 0: their bytes are a function
of the tokens, which the pool's keys already name.
"""

from __future__ import annotations

import hashlib
from functools import lru_cache

import numpy as np
import torch

from app.kvcache.specs import AttentionSpec, MambaSpec, MLASpec, dtype_size, held_units

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_NP_INT = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}

# Stream ids inside the hash: K, V, MLA latent; state parts start at STATE_BASE.
K, V, LATENT, STATE_BASE = 0, 1, 2, 16


def request_salt(request_id: str) -> int:
    """A request's share of the fill: 64 bits of its id's sha256."""
    return int.from_bytes(hashlib.sha256(request_id.encode()).digest()[:8], "little")


def mix(
    layer: int,
    stream: int,
    pos: np.ndarray,
    unit: np.ndarray,
    elem: np.ndarray,
    salt: int = 0,
) -> np.ndarray:
    """splitmix64 over the packed coordinates (broadcasting); wraps by design."""
    with np.errstate(over="ignore"):
        x: np.ndarray = np.asarray(
            (np.uint64(layer) << np.uint64(52))
            ^ (np.uint64(stream) << np.uint64(44))
            ^ np.uint64(salt)
        )
        x = x ^ (pos.astype(np.uint64) << np.uint64(24)) ^ (unit.astype(np.uint64) << np.uint64(16))
        x = x ^ elem.astype(np.uint64)
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def as_int(view: torch.Tensor) -> torch.Tensor:
    """The same memory as a signed integer tensor of the element size (bit-exact compares)."""
    return view.view(_INT_VIEW[view.element_size()])


def _bits(values: np.ndarray, size: int) -> torch.Tensor:
    return torch.from_numpy(values.astype(_NP_INT[size]))


def token_values(
    spec: AttentionSpec | MLASpec,
    layer: int,
    stream: int,
    tokens: np.ndarray,
    tp: int,
    rank: int,
    salt: int = 0,
) -> torch.Tensor:
    """Values for ``tokens``: ``(T, heads_on_rank, head_size)`` for attention, ``(T, row)`` bytes
    for MLA."""
    if isinstance(spec, MLASpec):
        row = spec.bytes_per_token(tp)
        vals = mix(
            layer,
            stream,
            tokens[:, None],
            np.zeros(1, np.int64)[None, :],
            np.arange(row)[None, :],
            salt,
        )
        return _bits(vals & np.uint64(0xFF), 1)
    first, count = held_units(rank, tp, spec.num_kv_heads)
    hs = spec.head_size if stream == K else spec.head_size_v
    heads = np.arange(first, first + count)
    vals = mix(
        layer,
        stream,
        tokens[:, None, None],
        heads[None, :, None],
        np.arange(hs)[None, None, :],
        salt,
    )
    return _bits(vals, dtype_size(spec.dtype))


def state_values(
    spec: MambaSpec, layer: int, n_tokens: int, tp: int, rank: int, salt: int = 0
) -> dict[str, torch.Tensor]:
    """Every state tensor of one layer after ``n_tokens`` tokens, in this rank's shapes."""
    out: dict[str, torch.Tensor] = {}
    for si, state in enumerate(spec.states):
        size = dtype_size(state.dtype)
        if state.conv:
            cols = []
            for pi, part in enumerate(state.parts):
                first, count = held_units(rank, tp, part.units)
                unit = np.repeat(np.arange(first, first + count), part.unit_elems)
                elem = np.tile(np.arange(part.unit_elems), count)
                rows = np.arange(state.rows)[:, None]
                cols.append(
                    mix(
                        layer,
                        STATE_BASE + si * 8 + pi,
                        np.full(1, n_tokens)[None, :],
                        unit[None, :],
                        elem[None, :] + rows * part.unit_elems,
                        salt,
                    )
                )
            sd = np.concatenate(cols, axis=1)  # (rows, width)
            vals = sd if spec.conv_layout == "SD" else sd.T
        else:
            (part,) = state.parts
            first, count = held_units(rank, tp, part.units)
            flat = mix(
                layer,
                STATE_BASE + si * 8,
                np.full(1, n_tokens)[:, None],
                np.arange(first, first + count)[:, None],
                np.arange(part.unit_elems)[None, :],
                salt,
            )
            vals = flat.reshape(count, *state.unit_shape)
        out[state.name] = _bits(np.ascontiguousarray(vals), size)
    return out


@lru_cache(maxsize=8)
def sentinel_bytes(nbytes: int, buffer: int, seed: int) -> torch.Tensor:
    """What a sentinel-filled buffer holds before any transfer: every 8-byte word is a hash of
    (seed, buffer index, word offset), so a stray write of zeros, of another block's bytes or
    of the fill reads back as a change, wherever in the cache it lands. Cached: treat the
    tensor as read-only."""
    words = np.arange((nbytes + 7) // 8, dtype=np.uint64)
    with np.errstate(over="ignore"):
        x = words ^ (np.uint64(buffer) << np.uint64(48)) ^ np.uint64(seed)
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x = x ^ (x >> np.uint64(31))
    return torch.from_numpy(x.view(np.uint8)[:nbytes])
