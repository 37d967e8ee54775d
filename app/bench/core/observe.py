"""What ``bench pd`` reads from each system after a trial, the same way for both where both
have it: where the KV landed and when, what decode computed, what the transfer path cost.

- kv-sidecar: the prefill sidecar's per-layer timeline (``GET /v1/requests/{id}``: per layer
  signalled, submitted, landed, bytes; per step P's forward end) and the decode sidecar's
  records (``ended_at``). Absolute ``time.time()`` stamps of the sidecars' host (this one).
- MooncakeConnector: the events ``mooncake_peer`` appends (sent, landed at D, P finished).
- Decode's computed tokens, both: vLLM's own per-step log line (``--enable-logging-iteration-
  details``; the engines log with ``ITERATION_LOG_FORMAT``, a Unix time first).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx

from app.bench.core.stats import Iteration, parse_iterations

ITERATION_LOG_FORMAT = "%(created).6f %(levelname)s %(name)s: %(message)s"


def engine_logging_config() -> dict[str, Any]:
    """vLLM's logging for both systems' engines (``VLLM_LOGGING_CONFIG_PATH``): warnings as
    before, plus the stats logger's per-step lines, each stamped with its Unix time."""
    handler = {"class": "logging.StreamHandler", "formatter": "bench", "stream": "ext://sys.stdout"}
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"bench": {"format": ITERATION_LOG_FORMAT}},
        "handlers": {"bench": handler},
        "loggers": {
            "vllm": {"handlers": ["bench"], "level": "WARNING", "propagate": False},
            "vllm.v1.metrics.loggers": {"handlers": ["bench"], "level": "INFO", "propagate": False},
        },
    }


def write_logging_config(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(engine_logging_config()))
    return path


class LogTail:
    """An engine's log, read as it grows; vLLM's per-step lines found in it so far."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0
        self._partial = ""
        self.iterations: list[Iteration] = []

    def between(self, t0: float, t1: float) -> list[Iteration]:
        if self.path.exists():
            with self.path.open("rb") as f:
                f.seek(self._offset)
                data = f.read()
            self._offset += len(data)
            text = self._partial + data.decode(errors="replace")
            complete, _, self._partial = text.rpartition("\n")
            self.iterations += parse_iterations(complete)
        return [i for i in self.iterations if t0 <= i.at <= t1]


# ---- kv-sidecar: the per-layer timeline ------------------------------------------------------


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def sidecar_timeline(
    sends: Sequence[Mapping[str, Any]], recvs: Sequence[Mapping[str, Any]]
) -> dict[str, Any]:
    """A trial's transfer from the sidecars' own records (``*_at``: Unix seconds).

    ``kv_landed``: the last layer write P's sidecar saw land at D (``None`` unless every layer
    landed); ``d_done``: the last of D's records that ended DONE; ``forward_began``: when the
    engine announced the first of the trial's steps; ``forward_end``: the end of P's last
    forward among them; ``layer_write_s``: the median of one layer's
    write, submitted → landed; the count of layers signalled during P's forward and only at its
    step's end (every layer at the end: the push was not layer-wise)."""
    layers = [x for e in sends for x in e.get("layers") or ()]
    steps = [x for e in sends for x in e.get("steps") or ()]
    landed = [float(x["landed_at"]) for x in layers if x.get("landed_at") is not None]
    writes = [
        float(x["landed_at"]) - float(x["submitted_at"])
        for x in layers
        if x.get("landed_at") is not None and x.get("submitted_at") is not None
    ]
    forward = [float(s["forward_ended_at"]) for s in steps if s.get("forward_ended_at") is not None]
    began = [float(s["began_at"]) for s in steps if s.get("began_at") is not None]
    signalled = [float(x["signalled_at"]) for x in layers if x.get("signalled_at") is not None]
    done = [
        float(r["ended_at"])
        for r in recvs
        if r.get("state") == "DONE" and r.get("ended_at") is not None
    ]
    return {
        "kv_landed": max(landed) if landed and len(landed) == len(layers) else None,
        "first_landed": min(landed) if landed else None,
        "last_signalled": max(signalled) if signalled else None,
        "forward_began": min(began) if began else None,
        "forward_end": max(forward) if forward else None,
        "d_done": max(done) if done else None,
        "layer_write_s": _median(writes),
        "layers": len(layers),
        "layers_landed": len(landed),
        "layers_in_forward": sum(int(s.get("layers_in_forward") or 0) for s in steps),
        "layers_at_step_end": sum(int(s.get("layers_at_step_end") or 0) for s in steps),
    }


def ended_within(rows: Sequence[Mapping[str, Any]], t0: float, t1: float) -> list[dict[str, Any]]:
    """The records that ended in ``[t0, t1]`` (a trial's: one system has a request in flight at
    a time, and every record of a trial ends before its answers are back)."""
    return [dict(r) for r in rows if r.get("ended_at") is not None and t0 <= r["ended_at"] <= t1]


def _listed(admin: str, side: str) -> list[dict[str, Any]]:
    params = {"side": side, "ended": "true"}
    return list(httpx.get(f"{admin}/v1/requests", params=params, timeout=10).json()["requests"])


def _send_detail(admin: str, rid: str) -> list[dict[str, Any]]:
    r = httpx.get(f"{admin}/v1/requests/{quote(rid, safe='')}", timeout=10)
    r.raise_for_status()
    return [e for e in r.json()["entries"] if e["side"] == "send"]


def sidecar_transfers(
    prefill_admin: str, decode_admin: str, t0: float, t1: float
) -> dict[str, Any]:
    """The trial's sends (each with its layer timeline) and D's records; landings at D."""
    listed = ended_within(_listed(prefill_admin, "send"), t0, t1)
    sends = [
        e
        for rid in dict.fromkeys(r["id"] for r in listed)
        for e in _send_detail(prefill_admin, rid)
    ]
    recvs = ended_within(_listed(decode_admin, "recv"), t0, t1)
    keep = (
        *("id", "side", "state", "created_at", "ended_at", "bytes", "error", "digest"),
        *("digest_ms", "digest_early_layers", "digest_early_ms", "digest_early_checks"),
    )
    return {
        "bytes": sum(int(r["bytes"] or 0) for r in sends),
        "landed": sorted(float(r["ended_at"]) for r in recvs if r["state"] == "DONE"),
        "timeline": sidecar_timeline(sends, recvs),
        "p_finished": [],  # not observable from outside kv-sidecar's connector: the tap's end
        "records": [{k: r.get(k) for k in keep} | _compact(r) for r in sends]
        + [{k: r.get(k) for k in keep} for r in recvs],
    }


LAYER_COLUMNS = (
    "step",
    "layer",
    "group",
    "signalled_at",
    "at_step_end",
    "submitted_at",
    "landed_at",
    "bytes",
)


def _compact(send: Mapping[str, Any]) -> dict[str, Any]:
    """A send's timeline as rows (``LAYER_COLUMNS``): pd.json keeps every trial's."""
    return {
        "layer_columns": list(LAYER_COLUMNS),
        "layers": [[x.get(c) for c in LAYER_COLUMNS] for x in send.get("layers") or ()],
        "steps": list(send.get("steps") or ()),
    }


# ---- MooncakeConnector: mooncake_peer's events -----------------------------------------------


def mooncake_transfers(events: Path, t0: float, t1: float) -> dict[str, Any]:
    rows = [json.loads(line) for line in events.read_text().splitlines()] if events.exists() else []
    rows = [r for r in rows if t0 <= r["t"] <= t1]
    return {
        "bytes": sum(int(r["bytes"]) for r in rows if r["ev"] == "sent"),
        # D's receiver adds a request here when its pull ended, failed pulls too: decode's
        # computed tokens tell which ones loaded (core.stats.failed_loads).
        "landed": sorted(r["t"] for r in rows if r["ev"] == "d_landed"),
        "timeline": None,
        "p_finished": sorted(r["t"] for r in rows if r["ev"] == "p_finished"),
        "records": rows,
    }
