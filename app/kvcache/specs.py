"""Per-layer KV cache specs and vLLM 0.33's page-size formulas.

A spec is TP-agnostic: it holds the model's global head / channel counts. ``per_rank`` views
(page sizes, shapes) take the TP size, because the same model is laid out differently on a
prefill instance with TP 4 and a decode instance with TP 2.

Every sharded quantity is counted in *units* (a KV head, a Mamba head, a B/C group), never in
raw channels, so a TP size that would split a head is rejected instead of silently mis-sliced.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from math import prod
from typing import TYPE_CHECKING

from app.errors import ConfigError

if TYPE_CHECKING:
    import torch


class SpecKind(StrEnum):
    FULL = "full_attention"
    SLIDING = "sliding_window"
    MLA = "mla"
    MAMBA = "mamba"


class RegionKind(StrEnum):
    """How a region's bytes are split across TP ranks (DESIGN §1)."""

    SPLIT = "SPLIT"
    REPLICATE = "REPLICATE"
    STATE = "STATE"


# Bytes move as raw bits, so fp8 variants are carried as uint8 storage of the same size. Names
# and sizes only: the proxy and the control plane plan with them and never import torch.
DTYPE_BYTES: dict[str, int] = {
    "bfloat16": 2,
    "float16": 2,
    "float32": 4,
    "fp8": 1,
    "fp8_e4m3": 1,
    "uint8": 1,
}
_STORAGE = {"bfloat16": "bfloat16", "float16": "float16", "float32": "float32"}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype a dtype name's bytes are viewed as (fp8 variants as uint8)."""
    import torch

    dtype_size(name)  # an unknown name fails with the names it could have been
    dtype: torch.dtype = getattr(torch, _STORAGE.get(name, "uint8"))
    return dtype


def dtype_size(name: str) -> int:
    """Bytes per element of a dtype name."""
    try:
        return DTYPE_BYTES[name]
    except KeyError:
        raise ConfigError(
            f"unknown dtype {name!r}; expected one of {', '.join(sorted(DTYPE_BYTES))}"
        ) from None


def held_units(rank: int, tp: int, units: int) -> tuple[int, int]:
    """(first global unit, count) held by ``rank`` of ``tp`` ranks.

    ``tp <= units``: an even split. ``tp > units``: each unit is replicated on ``tp // units``
    consecutive ranks (vLLM's ``max(1, H // tp)`` heads per rank).
    """
    if not 0 <= rank < tp:
        raise ConfigError(f"rank {rank} is outside TP size {tp}")
    if tp <= units:
        if units % tp:
            raise ConfigError(
                f"{units} heads/groups cannot be split evenly over TP {tp}; "
                f"use a TP size that divides {units}"
            )
        n = units // tp
        return rank * n, n
    if tp % units:
        raise ConfigError(
            f"TP {tp} cannot replicate {units} heads evenly; use a multiple of {units}"
        )
    return rank // (tp // units), 1


@dataclass(frozen=True)
class AttentionSpec:
    """GQA full attention or sliding window: ``[K | V]`` per block."""

    kind: SpecKind
    num_kv_heads: int
    head_size: int
    head_size_v: int
    dtype: str
    sliding_window: int | None = None

    @property
    def region_kind(self) -> RegionKind:
        return RegionKind.SPLIT

    def heads_per_rank(self, tp: int) -> int:
        return max(1, self.num_kv_heads // tp)

    def bytes_per_token(self, tp: int) -> int:
        """K and V bytes of one token on one rank (vLLM's ``page_size_bytes`` at block size 1)."""
        return (
            self.heads_per_rank(tp) * (self.head_size + self.head_size_v) * dtype_size(self.dtype)
        )

    def page_bytes(self, tp: int, block_size: int) -> int:
        return block_size * self.bytes_per_token(tp)

    def describe(self) -> str:
        extra = f", window {self.sliding_window}" if self.sliding_window else ""
        return f"{self.num_kv_heads} kv heads x {self.head_size}{extra}"


# vLLM 0.33 ``state_content_bytes`` for the packed DeepSeek formats.
PACKED_MLA_BYTES = {"fp8_ds_mla": 656, "nvfp4_ds_mla": 352}


@dataclass(frozen=True)
class MLASpec:
    """A latent vector per token, replicated on every rank (MLA, or the V3.2 indexer K cache)."""

    head_size: int
    dtype: str
    cache_dtype: str = "auto"
    indexer: bool = False

    kind = SpecKind.MLA

    @property
    def region_kind(self) -> RegionKind:
        return RegionKind.REPLICATE

    def bytes_per_token(self, tp: int) -> int:
        del tp  # replicated: identical on every rank
        if self.cache_dtype in PACKED_MLA_BYTES:
            return PACKED_MLA_BYTES[self.cache_dtype]
        return self.head_size * dtype_size(self.dtype)

    def page_bytes(self, tp: int, block_size: int) -> int:
        return block_size * self.bytes_per_token(tp)

    def describe(self) -> str:
        what = "indexer K" if self.indexer else "latent"
        return f"{what} {self.bytes_per_token(1)} B/token"


@dataclass(frozen=True)
class StatePart:
    """One TP-sharded slice of a state tensor: ``units`` global heads/groups of ``unit_elems``."""

    name: str
    units: int
    unit_elems: int


@dataclass(frozen=True)
class StateTensor:
    """A Mamba-style state tensor.

    ``conv``: shape ``(rows, Σ parts)`` in the SD layout, ``(Σ parts, rows)`` in DS; the parts are
    sub-projections (Mamba2 x|B|C, GDN/KDA q|k|v) split by TP separately.
    Not conv: shape ``(units/tp, *unit_shape)``, the ssm/recurrent state split by heads.
    """

    name: str
    dtype: str
    parts: tuple[StatePart, ...]
    rows: int = 1
    conv: bool = False
    unit_shape: tuple[int, ...] = ()

    def width(self, tp: int) -> int:
        """Elements of one conv row (or of the whole tensor, for ssm) on one rank."""
        return sum(held_units(0, tp, p.units)[1] * p.unit_elems for p in self.parts)

    def shape(self, tp: int, conv_layout: str) -> tuple[int, ...]:
        if self.conv:
            w = self.width(tp)
            return (self.rows, w) if conv_layout == "SD" else (w, self.rows)
        (part,) = self.parts
        return (held_units(0, tp, part.units)[1], *self.unit_shape)

    def nbytes(self, tp: int) -> int:
        return prod(self.shape(tp, "SD")) * dtype_size(self.dtype)


@dataclass(frozen=True)
class MambaSpec:
    """Mamba1/Mamba2/GDN/KDA state: one page holds the whole state of a request for one layer."""

    variant: str
    states: tuple[StateTensor, ...]
    conv_layout: str = "SD"

    kind = SpecKind.MAMBA

    @property
    def region_kind(self) -> RegionKind:
        return RegionKind.STATE

    def state_bytes(self, tp: int) -> int:
        return sum(s.nbytes(tp) for s in self.states)

    def page_bytes(self, tp: int, block_size: int) -> int:
        del block_size  # a state page does not grow with tokens
        return self.state_bytes(tp)

    def describe(self) -> str:
        shapes = ", ".join(f"{s.name}{s.shape(1, self.conv_layout)}" for s in self.states)
        return f"{self.variant} {shapes}"


LayerSpec = AttentionSpec | MLASpec | MambaSpec


def validate_tp(spec: LayerSpec, tp: int) -> None:
    """Raise ConfigError when ``tp`` cannot shard this spec."""
    if isinstance(spec, AttentionSpec):
        held_units(0, tp, spec.num_kv_heads)
    elif isinstance(spec, MambaSpec):
        for state in spec.states:
            for part in state.parts:
                if tp > part.units:
                    raise ConfigError(
                        f"{spec.variant} {state.name}.{part.name} has {part.units} heads/groups; "
                        f"TP {tp} would split one; use a TP size of at most {part.units}"
                    )
                held_units(0, tp, part.units)
