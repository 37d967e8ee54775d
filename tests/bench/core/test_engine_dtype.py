"""The benches' engine dtype: float32 where the CPU would emulate bf16, bf16 where it has it."""

from __future__ import annotations

from pathlib import Path

from app.bench.core.engine_dtype import choose_dtype, cpu_flags
from app.bench.core.systems import engine_args


def test_avx2_only_gets_float32() -> None:
    assert choose_dtype({"sse4_2", "avx2", "fma"}).dtype == "float32"


def test_native_bf16_keeps_bfloat16() -> None:
    assert choose_dtype({"avx2", "avx512f", "avx512_bf16"}).dtype == "bfloat16"
    assert choose_dtype({"avx2", "amx_bf16", "amx_tile"}).dtype == "bfloat16"


def test_flags_are_read_from_cpuinfo(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512_bf16\n\nprocessor\t: 1\n")
    assert cpu_flags(info) == {"fpu", "avx2", "avx512_bf16"}
    assert cpu_flags(tmp_path / "missing") == frozenset()


def test_the_choice_reaches_every_engines_flags() -> None:
    assert engine_args(4096, "float32")[-2:] == ["--dtype", "float32"]
    assert "--dtype" not in engine_args(4096)  # bench pd's shared regime: the model's own
