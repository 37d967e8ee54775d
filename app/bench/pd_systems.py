"""The two P/D systems ``bench pd`` compares, started the same way and observed the same way.

Both get the same model files and engine flags (``LocalPD``'s), a tap before P
(``pd_front tap``) and a front door the client talks to: kv-sidecar's own proxy, driven only
through ``LocalPD`` (so a change of its flow is what gets measured), and for vLLM's
``MooncakeConnector`` the minimal proxy in ``pd_front``.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from app.connectors.local_pd import MAX_MODEL_LEN, Instance, LocalPD
from app.ports import clear_port_file, wait_port_file
from app.store.master import free_port

SIDECAR, MOONCAKE = "kv-sidecar", "mooncake"
SYSTEMS = (SIDECAR, MOONCAKE)


def engine_args(max_model_len: int) -> list[str]:
    """Extra vLLM flags for both systems (LocalPD's own come first; argparse keeps the last)."""
    return ["--max-model-len", str(max(max_model_len, MAX_MODEL_LEN))]


class MooncakePD(LocalPD):
    """``LocalPD``'s engines with vLLM's ``MooncakeConnector`` (``mooncake_peer``) instead of
    kv-sidecar: no sidecar processes; P runs Mooncake's bootstrap server."""

    events: Path = Path()
    bootstrap_port: int = 0

    def start_instances(self, instances: Sequence[Instance]) -> None:
        self.events = self.work / "mooncake-events.jsonl"
        self.events.unlink(missing_ok=True)
        self.bootstrap_port = free_port()
        for inst in instances:
            producer = inst is self.prefill
            ktc = {
                "kv_connector": "BenchMooncakeConnector",
                "kv_connector_module_path": "app.bench.mooncake_peer",
                "kv_role": "kv_producer" if producer else "kv_consumer",
                "engine_id": f"mooncake-{inst.role}",
                "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": {"mooncake_protocol": "tcp"},
            }
            self._spawn(
                f"vllm-{inst.role}",
                [*_vllm_command(self.model, inst.vllm_port, ktc), *self.extra_vllm_args],
                {
                    "VLLM_CPU_KVCACHE_SPACE": "1",
                    "VLLM_LOGGING_LEVEL": "WARNING",
                    # D starts no bootstrap server, but must not collide with P's if it did.
                    "VLLM_MOONCAKE_BOOTSTRAP_PORT": str(
                        self.bootstrap_port if producer else free_port()
                    ),
                    "KVS_BENCH_EVENTS": str(self.events),
                },
            )

    @property
    def bootstrap(self) -> str:
        return f"http://127.0.0.1:{self.bootstrap_port}"


def _vllm_command(model: Path, port: int, ktc: dict[str, Any]) -> list[str]:
    # The flags LocalPD gives its engines, so that both systems run the same engine.
    return [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--served-model-name",
        "tiny",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--skip-tokenizer-init",
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--enforce-eager",
        "--no-enable-prefix-caching",
        "--max-num-seqs",
        "16",
        "--kv-transfer-config",
        json.dumps(ktc),
        "--tensor-parallel-size",
        "1",
    ]


@dataclasses.dataclass
class System:
    """One running P/D system: its front door, its P (direct and through the tap), its D."""

    name: str
    pd: LocalPD
    front: str = ""
    tap: str = ""

    @property
    def prefill(self) -> str:
        return self.pd.prefill.url

    @property
    def decode(self) -> str:
        return self.pd.decode.url

    def taps(self, t0: float, t1: float) -> list[dict[str, Any]]:
        rows = httpx.get(f"{self.tap}/bench/taps", timeout=10).json()["taps"]
        return [r for r in rows if t0 <= r["arrived"] <= t1 and r["path"] == "/v1/completions"]

    def transfers(self, t0: float, t1: float) -> dict[str, Any]:
        """What the transfer agents saw in ``[t0, t1]``: bytes, landing times at D, count."""
        if isinstance(self.pd, MooncakePD):
            return _mooncake_transfers(self.pd.events, t0, t1)
        return _sidecar_transfers(self.pd, t0, t1)


def _mooncake_transfers(events: Path, t0: float, t1: float) -> dict[str, Any]:
    rows = [json.loads(line) for line in events.read_text().splitlines()] if events.exists() else []
    rows = [r for r in rows if t0 <= r["t"] <= t1]
    return {
        "bytes": sum(int(r["bytes"]) for r in rows if r["ev"] == "sent"),
        "landed": sorted(r["t"] for r in rows if r["ev"] == "d_landed"),
        "p_finished": sorted(r["t"] for r in rows if r["ev"] == "p_finished"),
        "records": rows,
    }


def _entries(admin: str, side: str) -> list[dict[str, Any]]:
    """The sidecar's requests with wall-clock times. The API gives ages as of some moment while
    it answered; the middle of the call stands for it, off by at most half the call (``err``):
    on a busy host a call took over 100 ms, and "now" taken before it put requests before the
    trial that held them."""
    before = time.time()
    params = {"side": side, "ended": "true"}
    rows = httpx.get(f"{admin}/v1/requests", params=params, timeout=10).json()["requests"]
    after = time.time()
    now, err = (before + after) / 2, (after - before) / 2
    for r in rows:
        r["created"] = now - float(r["age_s"])
        r["ended"] = None if r["duration_s"] is None else r["created"] + float(r["duration_s"])
        r["err"] = err
    return list(rows)


def _sidecar_transfers(pd: LocalPD, t0: float, t1: float) -> dict[str, Any]:
    def within(r: dict[str, Any]) -> bool:
        return bool(t0 - r["err"] - 0.01 <= r["created"] <= t1 + r["err"])

    sends = [r for r in _entries(pd.prefill.admin, "send") if within(r)]
    recvs = [r for r in _entries(pd.decode.admin, "recv") if within(r)]
    return {
        "bytes": sum(int(r["bytes"] or 0) for r in sends),
        "landed": sorted(r["ended"] for r in recvs if r["state"] == "DONE" and r["ended"]),
        "p_finished": [],  # not observable from outside kv-sidecar's connector: the tap's end
        "records": [
            {k: r[k] for k in ("id", "side", "state", "created", "ended", "err", "bytes", "error")}
            for r in sends + recvs
        ],
    }


def _spawn_front(pd: LocalPD, name: str, args: list[str]) -> str:
    ports = pd.work / f"{name}.ports"
    clear_port_file(ports)
    cmd = [sys.executable, "-m", "app.bench.pd_front", *args, "--port-file", str(ports)]
    pd._spawn(name, cmd)
    check = lambda: pd._check_alive(name)  # noqa: E731
    return f"http://127.0.0.1:{wait_port_file(ports, ('port',), 60, check=check)['port']}"


def start_systems(model: Path, work: Path, max_model_len: int) -> list[System]:
    """Both systems, engines starting side by side; returns once every front answers."""
    args = engine_args(max_model_len)
    side = LocalPD(model, work / "kv-sidecar", kind="llama", extra_vllm_args=args)
    moon = MooncakePD(model, work / "mooncake", kind="llama", extra_vllm_args=args)
    systems = [System(SIDECAR, side), System(MOONCAKE, moon)]
    try:
        # One system after the other: four engines starting at once on two busy cores timed
        # out torch's shared-memory manager handshake (1 s) in one of them.
        for s in systems:
            s.pd.start_instances((s.pd.prefill, s.pd.decode))
            s.tap = _spawn_front(s.pd, "tap", ["tap", "--upstream", s.prefill])
            s.pd.wait_engine(s.pd.prefill, 900)
            s.pd.wait_engine(s.pd.decode, 900)
        tapped = dataclasses.replace(side.prefill, vllm_port=int(systems[0].tap.rsplit(":", 1)[1]))
        systems[0].front = side.start_proxy("proxy", tapped, side.decode)
        systems[1].front = _spawn_front(
            moon,
            "proxy",
            [
                "mooncake",
                *("--prefill", systems[1].tap, "--decode", moon.decode.url),
                *("--bootstrap", moon.bootstrap, "--engine-id", "mooncake-prefill"),
            ],
        )
    except BaseException:
        stop_systems(systems)
        raise
    return systems


def stop_systems(systems: Sequence[System]) -> None:
    for s in systems:
        s.pd.close()
