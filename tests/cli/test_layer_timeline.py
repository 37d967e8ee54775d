"""The demo's layer timeline read from two sidecar records (pure), printed and drawn."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from app.cli.layer_timeline import from_dict, plot, print_table, timeline

T0 = 1_800_000_000.0


def _records() -> tuple[dict, dict]:
    # Layer 0 and 1 signalled as the forward pass wrote them; a state layer only at its end.
    layers = [
        {"step": 4, "layer": 0, "signalled_at": T0 + 0.100, "at_step_end": False,
         "submitted_at": T0 + 0.101, "landed_at": T0 + 0.106, "bytes": 2048},
        {"step": 4, "layer": 1, "signalled_at": T0 + 0.200, "at_step_end": False,
         "submitted_at": T0 + 0.2015, "landed_at": T0 + 0.2095, "bytes": 2048},
        {"step": 4, "layer": 2, "signalled_at": T0 + 0.300, "at_step_end": True,
         "submitted_at": None, "landed_at": None, "bytes": 0},
    ]  # fmt: skip
    steps = [{"step": 4, "began_at": T0 + 0.010, "forward_ended_at": T0 + 0.290}]
    return {"layers": layers, "steps": steps}, {"ended_at": T0 + 0.320}


def test_times_are_ms_from_prefills_forward_start() -> None:
    send, recv = _records()
    tl = timeline("r1", send, recv)
    assert tl.steps == [(4, 0.0, 280.0)]
    assert [(r.layer, r.signalled_ms, r.submitted_ms, r.landed_ms) for r in tl.rows] == [
        (0, 90.0, 91.0, 96.0),
        (1, 190.0, 191.5, 199.5),
        (2, 290.0, None, None),
    ]
    assert [r.at_step_end for r in tl.rows] == [False, False, True]
    assert tl.decode_done_ms == 310.0
    assert from_dict(tl.as_dict()) == tl


def test_printed_and_drawn(tmp_path: Path) -> None:
    tl = timeline("r1", *_records())
    console = Console(record=True, width=120)
    print_table(console, tl)
    text = console.export_text()
    assert "2/3 layers landed before its end" in text and "290.0 (step end)" in text
    out = plot(tl, tmp_path / "t.png")
    assert out is not None and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
