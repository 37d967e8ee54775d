"""Our KV cache groups against vLLM's own grouping code, for every preset and TP 1, 2, 4.

The oracle builds vLLM ``KVCacheSpec`` objects the way vLLM's layers do, from the presets' raw
JSON facts (never from ``app.kvcache.specs`` page-size formulas): attention specs from head
counts and sizes, Mamba-style specs from vLLM's own model classes (``get_mamba_state_shape_from
_config`` on an HF-like config holding the preset's facts), the hybrid block size from vLLM's
``Platform._align_hybrid_block_size``. Then vLLM's ``get_kv_cache_groups`` and
``get_kv_cache_config_from_groups`` group the layers and place their tensors, and we compare
group count, membership and order, block and page sizes, which layers share a tensor, and the
block count for one memory budget.

Assumptions both sides share: bf16 models, ``--kv-cache-dtype auto``, FlashAttention for GQA
(kernel block ``MultipleOf(16)``), FlashMLA / FlashMLA-sparse for MLA (64), Mamba ``align``
mode (prefix caching; in ``none`` mode vLLM gives state groups ``max_model_len`` as block size),
SD conv layout, a per-layer (layer-outermost, ``LBNHC``) KV cache layout.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import cache
from importlib import resources
from types import SimpleNamespace
from typing import Any

import pytest

from app.errors import ConfigError
from app.kvcache.groups import CacheConfig, build_cache_config, hybrid_block_size
from app.kvcache.presets import (
    CacheLayer,
    ModelSpec,
    _build_spec,
    _scaled_pattern,
    load_preset,
    preset_names,
)

torch = pytest.importorskip("torch")
pytest.importorskip("vllm", reason="the oracle is vLLM itself")

from vllm.config import CacheConfig as VllmCacheConfig  # noqa: E402
from vllm.config import VllmConfig  # noqa: E402
from vllm.config.model import ModelConfig  # noqa: E402
from vllm.model_executor.layers.attention.attention import (  # noqa: E402
    _largest_kernel_block_within,
)
from vllm.model_executor.models import ModelRegistry  # noqa: E402
from vllm.platforms.interface import Platform  # noqa: E402
from vllm.v1.attention.backend import MultipleOf  # noqa: E402
from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend  # noqa: E402
from vllm.v1.attention.backends.mla.flashmla import FlashMLABackend  # noqa: E402
from vllm.v1.attention.backends.mla.flashmla_sparse import FlashMLASparseBackend  # noqa: E402
from vllm.v1.core.kv_cache_utils import (  # noqa: E402
    get_kv_cache_config_from_groups,
    get_kv_cache_groups,
)
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    SparseCacheRole,
    UniformTypeKVCacheSpecs,
    get_kv_quant_mode,
)

TPS = (1, 2, 4)
# Full presets plus the scaled-down ones the demo and the simulated engine use.
LAYER_COUNTS: tuple[int | None, ...] = (None, 4, 8)
MEMORY = 1 << 34  # bytes of KV cache per rank; only arithmetic, nothing is allocated
DTYPE = torch.bfloat16
# The architecture vLLM would load for each hybrid preset (the HF config's ``architectures``).
HYBRID_ARCH = {
    "qwen3-next-80b-a3b": "Qwen3NextForCausalLM",
    "nemotron-nano-9b-v2": "NemotronHForCausalLM",
    "kimi-linear-48b-a3b": "KimiLinearForCausalLM",
}
STATE_TYPES = {"gdn", "mamba2", "kda", "mamba1"}
CASES = [(name, tp, n) for name in preset_names() for tp in TPS for n in LAYER_COUNTS]


@cache
def raw_preset(name: str) -> dict[str, Any]:
    """The preset's JSON facts, read as data (not through ``app.kvcache.presets``)."""
    for f in resources.files("app.kvcache").joinpath("presets").iterdir():
        if f.name.endswith(".json"):
            data = json.loads(f.read_text())
            if data["name"] == name:
                return data
    raise KeyError(name)


def layer_facts(name: str, layers: int | None) -> list[dict[str, Any]]:
    """One raw spec entry per cache-carrying layer, in registration order.

    The scaled pattern (which model layers a ``--layers N`` preset keeps) is an input both sides
    share, so it comes from the preset loader; everything sized is computed here.
    """
    raw = raw_preset(name)
    pattern: str = raw["layers"]
    if layers is not None:
        pattern = _scaled_pattern(pattern, {k for k, v in raw["specs"].items() if v}, layers)
    return [entry for ch in pattern for entry in raw["specs"][ch]]


def layer_name(i: int) -> str:
    return f"model.layers.{i}.attn"


def min_kernel_block(backend: Any) -> int:
    return min(
        s.base if isinstance(s, MultipleOf) else s
        for s in backend.get_supported_kernel_block_sizes()
    )


def kv_heads_per_rank(total: int, tp: int, *, mla: bool = False) -> int:
    """vLLM's ``ModelConfig.get_num_kv_heads``, on a stand-in config holding only the heads."""
    model_config = SimpleNamespace(
        use_mla=mla, model_arch_config=SimpleNamespace(total_num_kv_heads=total)
    )
    return ModelConfig.get_num_kv_heads(model_config, SimpleNamespace(tensor_parallel_size=tp))  # type: ignore[arg-type]


def hf_config(arch: str, state: dict[str, Any]) -> SimpleNamespace:
    """The HF config fields vLLM's model class reads for its state shapes, from the facts."""
    if arch == "Qwen3NextForCausalLM":
        return SimpleNamespace(
            linear_num_key_heads=state["num_k_heads"],
            linear_num_value_heads=state["num_v_heads"],
            linear_key_head_dim=state["head_k_dim"],
            linear_value_head_dim=state["head_v_dim"],
            linear_conv_kernel_dim=state["conv_kernel"],
        )
    if arch == "NemotronHForCausalLM":
        return SimpleNamespace(
            mamba_num_heads=state["num_heads"],
            mamba_head_dim=state["head_dim"],
            n_groups=state["n_groups"],
            ssm_state_size=state["state_size"],
            conv_kernel=state["conv_kernel"],
        )
    assert arch == "KimiLinearForCausalLM"
    return SimpleNamespace(
        linear_attn_config={
            "num_heads": state["num_heads"],
            "head_dim": state["head_dim"],
            "short_conv_kernel_size": state["conv_kernel"],
        }
    )


@dataclass(frozen=True)
class VllmSide:
    """What vLLM builds for one preset and TP size."""

    block_size: int  # after hybrid alignment
    groups: list[Any]  # KVCacheGroupSpec
    config: KVCacheConfig
    specs: dict[str, KVCacheSpec]


def vllm_build(facts: list[dict[str, Any]], tp: int, arch: str | None = None) -> VllmSide:
    """vLLM's groups and tensors for layers with these raw facts (``arch``: a hybrid's model)."""
    types = {f["type"] for f in facts}
    attn = [f for f in facts if f["type"] not in STATE_TYPES]
    states = [f for f in facts if f["type"] in STATE_TYPES]
    has_mla = bool(types & {"mla", "indexer"})
    mla_backend = FlashMLASparseBackend if "indexer" in types else FlashMLABackend
    backends = [mla_backend] if has_mla else [FlashAttentionBackend]
    # The block size every attention backend accepts, before any hybrid raise.
    block_size = math.lcm(*(min_kernel_block(b) for b in backends))

    cache_config = VllmCacheConfig(block_size=block_size, mamba_cache_mode="align")
    if states:
        (state,) = {json.dumps(s, sort_keys=True) for s in states}
        state_facts = json.loads(state)
        ssm_dtype = state_facts.get("ssm_dtype", state_facts.get("recurrent_dtype", "auto"))
        cache_config.mamba_ssm_cache_dtype = ssm_dtype
        assert arch is not None, "a state layer needs the model class that sizes it"
        (attn_facts,) = {json.dumps(a, sort_keys=True) for a in attn}
        a = json.loads(attn_facts)
        hf = hf_config(arch, state_facts)
        model_config = SimpleNamespace(
            dtype=DTYPE,
            use_mla=has_mla,
            architecture=arch,
            hf_config=hf,
            hf_text_config=hf,
            model_impl="auto",
            convert_type="none",
            runner_type="generate",
            get_head_size=lambda: a["head_size"],
            get_num_kv_heads=lambda pc: kv_heads_per_rank(
                a.get("num_kv_heads", 1), pc.tensor_parallel_size, mla=has_mla
            ),
        )
        stand_in = SimpleNamespace(
            cache_config=cache_config,
            model_config=model_config,
            parallel_config=SimpleNamespace(tensor_parallel_size=tp),
            speculative_config=None,
            num_speculative_tokens=0,
        )

        class _Platform(Platform):
            @classmethod
            def _find_non_ssm_backends(cls, vllm_config: Any) -> list[Any]:
                return backends

        # In "align" mode this raises the block size, sets the state groups' block size to it
        # and pads the state page to one attention page.
        _Platform._align_hybrid_block_size(stand_in, backends[0])  # type: ignore[arg-type]
        model_cls: Any = ModelRegistry.resolve_model_cls(arch, model_config=model_config)[0]  # type: ignore[arg-type]
        assert cache_config.mamba_block_size is not None
        state_spec = MambaSpec(
            shapes=tuple(model_cls.get_mamba_state_shape_from_config(stand_in)),
            dtypes=tuple(model_cls.get_mamba_state_dtype_from_config(stand_in)),
            block_size=cache_config.mamba_block_size,
            page_size_padded=cache_config.mamba_page_size_padded,
            mamba_cache_mode="align",
        )
    bs = cache_config.block_size

    specs: dict[str, KVCacheSpec] = {}
    for i, f in enumerate(facts):
        kind = f["type"]
        if kind in STATE_TYPES:
            specs[layer_name(i)] = state_spec
        elif kind == "attention":
            heads = kv_heads_per_rank(f["num_kv_heads"], tp)
            hs, hsv = f["head_size"], f.get("head_size_v", f["head_size"])
            if f["kind"] == "sliding_window":
                # As vLLM's Attention.get_kv_cache_spec picks a sliding-window block size.
                one = FlashAttentionBackend.customize_spec(
                    SlidingWindowSpec(
                        block_size=1,
                        num_kv_heads=heads,
                        head_size=hs,
                        head_size_v=hsv,
                        dtype=DTYPE,
                        sliding_window=f["sliding_window"],
                    )
                )
                per_token = one.real_page_size_bytes
                sw_bs = _largest_kernel_block_within(
                    FlashAttentionBackend, per_token, per_token * bs, bs, one
                )
                specs[layer_name(i)] = SlidingWindowSpec(
                    block_size=sw_bs,
                    num_kv_heads=heads,
                    head_size=hs,
                    head_size_v=hsv,
                    dtype=DTYPE,
                    sliding_window=f["sliding_window"],
                )
            else:
                specs[layer_name(i)] = FullAttentionSpec(
                    block_size=bs, num_kv_heads=heads, head_size=hs, head_size_v=hsv, dtype=DTYPE
                )
        elif kind == "mla":
            specs[layer_name(i)] = MLAAttentionSpec(
                block_size=bs,
                num_kv_heads=1,
                max_tp_shards=1,
                head_size=f["head_size"],
                dtype=DTYPE,
                cache_dtype_str="auto",
                kv_quant_mode=get_kv_quant_mode("auto"),
                is_index_group_leader="indexer" in types,
            )
        else:
            assert kind == "indexer"  # DeepseekV32IndexerCache: uint8 rows, one vector a token
            specs[layer_name(i)] = MLAAttentionSpec(
                block_size=bs,
                num_kv_heads=1,
                max_tp_shards=1,
                head_size=f["head_size"],
                dtype=torch.uint8,
                cache_role=SparseCacheRole.INDEXER,
            )

    vllm_config = VllmConfig(cache_config=VllmCacheConfig(block_size=bs))
    vllm_config.cache_config.kv_cache_layout = "LBNHC"
    groups = get_kv_cache_groups(vllm_config, dict(specs))
    config = get_kv_cache_config_from_groups(vllm_config, groups, MEMORY)
    return VllmSide(bs, groups, config, specs)


def ours(name: str, tp: int, layers: int | None) -> CacheConfig:
    model = load_preset(name, layers=layers)
    return build_cache_config(model, tp, model.default_block_size(), memory_bytes=MEMORY)


def per_layer_spec(group: Any, name: str) -> KVCacheSpec:
    spec = group.kv_cache_spec
    return spec.kv_cache_specs[name] if isinstance(spec, UniformTypeKVCacheSpecs) else spec


@pytest.mark.parametrize(("name", "tp", "layers"), CASES)
def test_groups_match_vllm(name: str, tp: int, layers: int | None) -> None:
    try:
        mine = ours(name, tp, layers)
    except ConfigError:
        # Every preset supports TP 1, 2 and 4 today; a rejection must be one vLLM shares.
        with pytest.raises((AssertionError, ValueError, NotImplementedError)):
            vllm_build(layer_facts(name, layers), tp, HYBRID_ARCH.get(name))
        return
    assert_same(mine, vllm_build(layer_facts(name, layers), tp, HYBRID_ARCH.get(name)))


def assert_same(mine: CacheConfig, v: VllmSide) -> None:
    """Same groups (order, members, block and page sizes), shared tensors and block count."""
    assert len(mine.groups) == len(v.groups)
    for g, vg in zip(mine.groups, v.groups, strict=True):
        assert [layer_name(c.index) for c in g.layers] == vg.layer_names, f"group {g.index}"
        assert g.block_size == vg.kv_cache_spec.block_size
        for c in g.layers:
            vspec = per_layer_spec(vg, layer_name(c.index))
            assert mine.slot_of(c.index).page_bytes == vspec.page_size_bytes, c.name

    # Which layers share memory: vLLM overlays every group's tensors from byte 0, so a layer's
    # region is (offset + position * layer_stride); ours is the slot the layer sits in.
    v_regions: dict[int, set[str]] = {}
    for t in v.config.kv_cache_tensors:
        for pos, lname in enumerate(t.layers):
            v_regions.setdefault(t.offset + pos * t.layer_stride, set()).add(lname)
            spec = per_layer_spec(next(g for g in v.groups if lname in g.layer_names), lname)
            assert t.block_stride == spec.page_size_bytes  # per-layer pages, no padding
    my_regions = {frozenset(layer_name(li) for _, li in s.members) for s in mine.slots}
    assert my_regions == {frozenset(s) for s in v_regions.values()}
    assert mine.num_blocks == v.config.num_blocks


@pytest.mark.parametrize(
    ("pattern", "groups"),
    [
        ("SF" * 12 + "F", 2),  # gpt-oss + EAGLE: 12 + 13 pads to two groups of 13
        ("SF" * 8 + "FFF", 2),  # 8 + 11: below 1.5x, padded (a 1.25 rule would give three)
        ("SF" * 10 + "FFFFF", 3),  # 10 + 15: exactly 1.5x, split
        ("SSF" * 7 + "S", 4),  # 15 + 7: stride groups of 8, 7 and 7
        ("SSSSF" * 3 + "SF", 5),  # 13 + 4, uneven stride split
    ],
)
def test_group_size_tolerance_and_stride_split_match_vllm(pattern: str, groups: int) -> None:
    raw = raw_preset("gpt-oss-20b")["specs"]
    facts = [raw[ch][0] for ch in pattern]
    model = ModelSpec(
        "synthetic",
        "none",
        "0",
        "bfloat16",
        tuple(
            CacheLayer(i, f"layers.{i}", _build_spec(f, "bfloat16", "auto", "SD", None))
            for i, f in enumerate(facts)
        ),
        len(facts),
    )
    for tp in TPS:
        mine = build_cache_config(model, tp, 16, memory_bytes=MEMORY)
        assert len(mine.groups) == groups
        assert_same(mine, vllm_build(facts, tp))


@pytest.mark.parametrize(
    ("name", "tp", "layers"), [c for c in CASES if c[0] in HYBRID_ARCH and c[2] is None]
)
def test_hybrid_block_size_matches_vllm(name: str, tp: int, layers: int | None) -> None:
    model = load_preset(name, layers=layers)
    v = vllm_build(layer_facts(name, layers), tp, HYBRID_ARCH[name])
    assert hybrid_block_size(model, tp, model.default_block_size()) == v.block_size
    # The padded state page is exactly one attention page, as vLLM pads it.
    pages = {s.page_size_bytes for s in v.specs.values()}
    assert len(pages) == 1
    assert {s.page_bytes for s in ours(name, tp, layers).slots} == pages


def test_every_preset_is_covered() -> None:
    # A new preset with a state layer needs its architecture here to be checked at all.
    for name in preset_names():
        if {f["type"] for f in layer_facts(name, None)} & STATE_TYPES:
            assert name in HYBRID_ARCH
