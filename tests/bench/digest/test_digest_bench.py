"""``python -m app.bench.digest``: a figure per run length, and its JSON with the host record."""

from __future__ import annotations

import json
from pathlib import Path

from app.bench.digest.bench import KINDS, main


def test_the_bench_writes_every_kind_with_its_host(tmp_path: Path) -> None:
    main(["--mib", "4", "--out", str(tmp_path / "d.json")])
    written = json.loads((tmp_path / "d.json").read_text())
    assert [r["kind"] for r in written["rows"]] == list(KINDS)
    for r in written["rows"]:
        assert r["ms_per_gb"] > 0 and r["cpu_s_per_gb"] >= 0, r
    # Shorter runs pay numpy's per-call cost: the 2 KiB slices cost more per GB than 2 MiB runs.
    assert written["rows"][-1]["ms_per_gb"] > written["rows"][0]["ms_per_gb"]
    assert written["host"]["cpu_model"] and written["host"]["commit"]


def test_the_device_path_is_measured_by_the_same_tool(tmp_path: Path) -> None:
    """``--device``: the torch path (here on CPU tensors; ``cuda`` on a GPU host)."""
    main(["--mib", "2", "--device", "cpu", "--out", str(tmp_path / "t.json")])
    written = json.loads((tmp_path / "t.json").read_text())
    assert written["path"] == "cpu"
    assert [r["kind"] for r in written["rows"]] == list(KINDS)
    assert all(r["ms_per_gb"] > 0 for r in written["rows"])
