"""The two P/D systems ``bench pd`` compares, started the same way and observed the same way.

Both get the same model files and engine flags (``LocalPD``'s), a tap before P
(``core.front tap``) and a front door the client talks to: kv-sidecar's own proxy, driven only
through ``LocalPD`` (so a change of its flow is what gets measured), and for vLLM's
``MooncakeConnector`` the minimal proxy in ``core.front``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx

from app.bench.core.cores import MOONCAKE_THREAD, descendants, named_threads_cpu_s, process_cpu_s
from app.bench.core.observe import (
    LogTail,
    mooncake_transfers,
    sidecar_transfers,
    write_logging_config,
)
from app.bench.core.stats import MOONCAKE, SIDECAR, Iteration
from app.errors import ConfigError
from app.harness.engines import MAX_MODEL_LEN, Instance, vllm_command, vllm_env
from app.harness.local_pd import LocalPD
from app.harness.waits import PrefillClock, ceil_gib
from app.ports import clear_port_file, wait_port_file
from app.store.master import free_port

SIDECAR_PROCESSES = ("sidecar-prefill", "sidecar-decode")  # LocalPD's names
# kv-sidecar's decode waits this long for prefill to start a request (recv_queue_timeout_s):
# past the knee requests queue at prefill for tens of seconds, and a decode that gave up would
# recompute prompts prefill still computes. The peer's decode hears of a request only once
# prefill answered, so it never gives up on a queued one either.
PREFILL_QUEUE_S = 600.0


def engine_args(max_model_len: int, dtype: str | None = None) -> list[str]:
    """Extra vLLM flags for both systems (LocalPD's own come first; argparse keeps the last).
    vLLM logs every step's computed tokens: what tells a load from a recomputed prompt.
    ``dtype`` (``engine_dtype``): vLLM's ``--dtype``; None: the model's own (bf16)."""
    return [
        "--max-model-len",
        str(max(max_model_len, MAX_MODEL_LEN)),
        "--enable-logging-iteration-details",
        *(("--dtype", dtype) if dtype else ()),
    ]


def kv_cache_env(
    model: Mapping[str, Any], tokens: int, dtype: str | None = None, headroom: float = 1.25
) -> dict[str, str]:
    """Each engine's ``VLLM_CPU_KVCACHE_SPACE`` for ``tokens`` in its cache at once (the
    longest prompt, or a concurrent workload's prompts together) of a Llama ``model`` config,
    K and V of every layer in ``dtype`` (None: the model's bf16); ``headroom`` for vLLM's
    whole blocks and the decoded tokens. vLLM refuses to start when one max-model-len sequence
    does not fit, and the harness's 1 GiB holds about 16k tokens of the 16-layer model."""
    heads = int(model.get("num_key_value_heads", model.get("num_attention_heads", 1)))
    head_dim = int(model.get("head_dim") or model["hidden_size"] // model["num_attention_heads"])
    width = 4 if dtype in ("float32", "float") else 2
    per_token = 2 * int(model["num_hidden_layers"]) * heads * head_dim * width
    return {"VLLM_CPU_KVCACHE_SPACE": str(ceil_gib(per_token * tokens * headroom))}


ENGINES = 4  # both systems' P and D run at once (trials alternate between the systems)
MEMORY_MARGIN = 4 << 30  # weights, activations, the sidecars, Mooncake's buffers, the tests


def check_kv_memory(kv_env: Mapping[str, str], memory_bytes: int) -> None:
    """A ``ConfigError`` (one line, before any engine starts) where the four engines' KV caches
    and ``MEMORY_MARGIN`` exceed the host's memory: vLLM allocates each cache whole at start,
    and a kernel out of memory would kill an engine mid-run."""
    each = int(kv_env["VLLM_CPU_KVCACHE_SPACE"])
    need = ENGINES * (each << 30) + MEMORY_MARGIN
    if need > memory_bytes:
        raise ConfigError(
            f"{ENGINES} engines x {each} GiB of KV cache + {MEMORY_MARGIN >> 30} GiB need "
            f"{need / 2**30:.0f} GiB; this host has {memory_bytes / 2**30:.0f} GiB: fewer "
            f"--layers or shorter --sizes"
        )


def memory_total(meminfo: Path = Path("/proc/meminfo")) -> int:
    """The host's memory in bytes (``MemTotal``)."""
    for line in meminfo.read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    raise ConfigError(f"no MemTotal in {meminfo}")


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
            self._spawn(
                f"vllm-{inst.role}",
                [
                    *_vllm_command(
                        self.model, inst.vllm_port, self.ktc(inst), self._prefix_caching(inst)
                    ),
                    *self.extra_vllm_args,
                ],
                {
                    **vllm_env(1, self.worker_in_core),
                    **self.engine_env,
                    # D starts no bootstrap server, but must not collide with P's if it did.
                    "VLLM_MOONCAKE_BOOTSTRAP_PORT": str(
                        self.bootstrap_port if producer else free_port()
                    ),
                    "KVS_BENCH_EVENTS": str(self.events),
                    **self.role_env.get(inst.role, {}),
                },
            )

    def ktc(self, inst: Instance) -> dict[str, Any]:
        """``inst``'s ``--kv-transfer-config`` (``core.store_pd`` adds the store)."""
        return {
            "kv_connector": "BenchMooncakeConnector",
            "kv_connector_module_path": "app.bench.core.mooncake_peer",
            "kv_role": "kv_producer" if inst is self.prefill else "kv_consumer",
            "engine_id": f"mooncake-{inst.role}",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"mooncake_protocol": "tcp"},
        }

    @property
    def bootstrap(self) -> str:
        return f"http://127.0.0.1:{self.bootstrap_port}"


def _vllm_command(model: Path, port: int, ktc: dict[str, Any], prefix_caching: bool) -> list[str]:
    # The flags LocalPD gives its engines, so that both systems run the same engine.
    return vllm_command(
        model,
        port,
        "--kv-transfer-config",
        json.dumps(ktc),
        "--tensor-parallel-size",
        "1",
        prefix_caching=prefix_caching,
    )


@dataclasses.dataclass
class System:
    """One running P/D system: its front door, its P (direct and through the tap), its D. A
    second ``System`` on the same ``pd`` (``twin``) measures the same system again: A/A, or
    an arm of it whose ``before_trial`` sets it up (``bench pd --digest``)."""

    name: str
    pd: LocalPD
    front: str = ""
    tap: str = ""
    before_trial: Callable[[], None] | None = None
    _d_log: LogTail | None = None
    _p_log: LogTail | None = None
    _cpu_pids: list[int] | None = None

    @property
    def prefill(self) -> str:
        return self.pd.prefill.url

    @property
    def decode(self) -> str:
        return self.pd.decode.url

    def twin(self, name: str, before_trial: Callable[[], None] | None = None) -> System:
        """This system under another name (its ``before_trial`` unless given one)."""
        return System(name, self.pd, self.front, self.tap, before_trial or self.before_trial)

    def taps(self, t0: float, t1: float) -> list[dict[str, Any]]:
        rows = httpx.get(f"{self.tap}/bench/taps", timeout=10).json()["taps"]
        return [r for r in rows if t0 <= r["arrived"] <= t1 and r["path"] == "/v1/completions"]

    def transfers(self, t0: float, t1: float) -> dict[str, Any]:
        """What the transfer agents saw in ``[t0, t1]``: bytes, landing times at D, count."""
        if isinstance(self.pd, MooncakePD):
            return mooncake_transfers(self.pd.events, t0, t1)
        return sidecar_transfers(self.pd.prefill.admin, self.pd.decode.admin, t0, t1)

    def decode_steps(self, t0: float, t1: float) -> list[Iteration]:
        """D's engine steps in ``[t0, t1]`` as vLLM logged them (what D computed)."""
        if self._d_log is None:
            self._d_log = LogTail(self.pd.work / f"vllm-{self.pd.decode.name}.log")
        return self._d_log.between(t0, t1)

    def prefill_steps(self, t0: float, t1: float) -> list[Iteration]:
        """P's engine steps in ``[t0, t1]`` as vLLM logged them."""
        if self._p_log is None:
            self._p_log = LogTail(self.pd.work / f"vllm-{self.pd.prefill.name}.log")
        return self._p_log.between(t0, t1)

    def process_groups(self) -> dict[str, list[int]]:
        """Every process this system started, by name (the roots of their trees)."""
        return {f"{self.name}/{n}": [p.pid] for n, p in self.pd.procs.items()}

    def transfer_cpu_s(self) -> float:
        """CPU seconds its transfer path has used so far (see ``CPU_SCOPE``)."""
        mooncake = isinstance(self.pd, MooncakePD)
        if self._cpu_pids is None:  # every process is up by the first trial
            roots = ("vllm-prefill", "vllm-decode") if mooncake else SIDECAR_PROCESSES
            self._cpu_pids = descendants(self.pd.procs[r].pid for r in roots)
        if mooncake:
            return named_threads_cpu_s(self._cpu_pids, MOONCAKE_THREAD)[0]
        return process_cpu_s(self._cpu_pids)


CPU_SCOPE = {
    SIDECAR: "the two sidecar processes (P's, D's) and their children, every thread",
    MOONCAKE: "inside the vLLM engines (the connector runs in each worker process): the threads "
    f"named {MOONCAKE_THREAD}, i.e. every thread MooncakeConnector started: its transfer "
    "engine's, the sender pool, the sender listener and receiver loops, the bootstrap server "
    "(mooncake_peer builds the connector on a thread of that name); not the connector's hooks "
    "on the worker's own thread, as kv-sidecar's connector hooks are not counted either",
}


def _spawn_front(pd: LocalPD, name: str, args: list[str]) -> str:
    ports = pd.work / f"{name}.ports"
    clear_port_file(ports)
    cmd = [sys.executable, "-m", "app.bench.core.front", *args, "--port-file", str(ports)]
    pd._spawn(name, cmd)
    check = lambda: pd._check_alive(name)  # noqa: E731
    return f"http://127.0.0.1:{wait_port_file(ports, ('port',), 60, check=check)['port']}"


def start_systems(
    model: Path,
    work: Path,
    max_model_len: int,
    dtype: str | None = None,
    names: Sequence[str] = (SIDECAR, MOONCAKE),
    role_env: Mapping[str, Mapping[str, str]] | None = None,
    engine_env: Mapping[str, str] | None = None,
) -> list[System]:
    """The named systems (both by default), one after the other; returns once every front
    answers. A name other than ``MOONCAKE`` is a kv-sidecar pair. ``role_env``: more env for
    each role's engines (``Binding.role_env``); ``engine_env``: more env for every engine (e.g.
    ``kv_cache_env``). The systems share one
    ``PrefillClock``: their engines are the same, so a prefill measured on one bounds the
    other's waits."""
    args = engine_args(max_model_len, dtype)
    clock = PrefillClock()
    # Every engine (both systems) logs with it; LocalPD's engines take this process's env.
    os.environ["VLLM_LOGGING_CONFIG_PATH"] = str(write_logging_config(work / "vllm-logging.json"))
    # Both with vllm-cpu's own worker process: the dedicated regime pins its forward thread.
    systems = [
        System(
            n,
            (MooncakePD if n == MOONCAKE else LocalPD)(
                model,
                work / n,
                kind="llama",
                extra_vllm_args=args,
                worker_in_core=False,
                recv_queue_timeout_s=PREFILL_QUEUE_S,
                role_env=role_env or {},
                engine_env=engine_env or {},
                clock=clock,
            ),
        )
        for n in names
    ]
    try:
        # One system after the other: four engines starting at once on two busy cores timed
        # out torch's shared-memory manager handshake (1 s) in one of them.
        for s in systems:
            s.pd.start_instances((s.pd.prefill, s.pd.decode))
            s.tap = _spawn_front(s.pd, "tap", ["tap", "--upstream", s.prefill])
            s.pd.wait_engine(s.pd.prefill, 900)
            s.pd.wait_engine(s.pd.decode, 900)
        for s in systems:
            if isinstance(s.pd, MooncakePD):
                s.front = start_mooncake_front(s.pd, s.tap)
            else:
                tapped = dataclasses.replace(s.pd.prefill, vllm_port=int(s.tap.rsplit(":", 1)[1]))
                s.front = s.pd.start_proxy("proxy", tapped, s.pd.decode)
    except BaseException:
        stop_systems(systems)
        raise
    return systems


def start_mooncake_front(moon: MooncakePD, prefill: str) -> str:
    """The minimal proxy before vLLM's ``MooncakeConnector`` pair (``core.front mooncake``),
    sending prompts to ``prefill`` (P's URL, or a tap before it); its URL."""
    args = ["mooncake", "--prefill", prefill, "--decode", moon.decode.url]
    args += ["--bootstrap", moon.bootstrap, "--engine-id", "mooncake-prefill"]
    return _spawn_front(moon, "proxy", args)


def stop_systems(systems: Sequence[System]) -> None:
    for s in systems:
        s.pd.close()
