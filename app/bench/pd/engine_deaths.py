"""Why an engine of a ``bench pd`` run went away, from its own log: a worker vLLM saw die,
with its exit code read (-9: SIGKILL, which the kernel's OOM killer sends when the host runs
out of memory; the bench's engines share it with whatever else runs there)."""

from __future__ import annotations

import re
from pathlib import Path

_DIED = re.compile(r"(Worker proc \S+ died unexpectedly \(exit code: (-?\d+)\))")
_SIGNALS = {-9: "SIGKILL: the kernel's OOM killer, when the host ran out of memory", -11: "SIGSEGV"}


def engine_deaths(work: Path) -> list[str]:
    """One line per engine log under ``work`` (``SYSTEM/vllm-ROLE.log``) that records a worker
    dying: ``SYSTEM/vllm-ROLE: Worker proc ... died unexpectedly (exit code: -9, SIGKILL ...)``."""
    out = []
    for log in sorted(work.glob("*/vllm-*.log")):
        found = _DIED.findall(log.read_text(errors="replace"))
        if found:
            text, code = found[-1]
            why = _SIGNALS.get(int(code))
            out.append(f"{log.parent.name}/{log.stem}: {text}" + (f" ({why})" if why else ""))
    return out
