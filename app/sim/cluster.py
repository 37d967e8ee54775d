"""A local P/D pair as separate processes: two sidecars and one simulated engine per TP rank.

The driver plays vLLM's scheduler and router: it allocates block ids on both instances, tells
D's ranks what to expect, hands P's ranks the requests with D's address and block ids, and
collects what D verified. Used by ``kv-sidecar demo``, the benchmarks and the end-to-end tests.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import zmq

from app.devices.shm import attach_allocator
from app.errors import DeadlineExceeded, KVSidecarError
from app.harness.zygote import start_process
from app.kvcache.layout import RankLayout
from app.kvcache.presets import load_preset
from app.ports import clear_port_file, wait_port_file
from app.sim.commands import Command, SimRequest
from app.sim.ranks import CacheParams, allocate_rank, preset_config
from app.sim.reference import BlockAllocator, blocks_needed
from app.sim.side import Side, target_signer
from app.store.master import MasterProcess, start_master, stop_master
from app.transfer.planning.planner import MambaMode
from app.transfer.wire.protocol import RemoteTarget
from app.transfer.wire.target_auth import prompt_digest


@dataclass
class ClusterSpec:
    model: str = "qwen3-next-80b-a3b"
    layers: int | None = 4
    prefill_tp: int = 2
    decode_tp: int = 1
    block_size: int | None = None
    layout: str = "per_layer"
    kv_layout: str = "HND"
    heads_major: bool = False
    conv_layout: str = "SD"
    # Roles whose engine process hosts its agent (``InProcessAgent``) instead of a sidecar process.
    in_process: tuple[str, ...] = ()
    max_requests: int = 8
    max_prompt: int = 1024
    num_spec: int = 0
    log_dir: str | None = None
    pool: bool = False  # start a mooncake_master and enable the KV pool on both sidecars
    pool_segment_bytes: int = 64 << 20  # what the prefill sidecar contributes (decode: 0)
    sidecar_env: dict[str, str] = field(default_factory=dict)
    # Per role, the command that starts its sidecar process instead of ``python -m app serve``
    # (tests: a launcher that hooks faults into the sidecar).
    sidecar_cmd: dict[str, list[str]] = field(default_factory=dict)
    prefill_env: dict[str, str] = field(default_factory=dict)
    decode_env: dict[str, str] = field(default_factory=dict)
    # Decode engines fill their whole cache with this sentinel seed at start, and ``untouched``
    # then compares every byte (see ``kv_io.changed_outside``); None: caches start zeroed.
    sentinel: int | None = None
    engine_link_timeout_s: float = 10.0  # engines' per-call timeout to their sidecar
    # An engine whose sidecar answered nothing this long fails its pending requests itself
    # (a sidecar killed under it); None: link errors end the driver's command instead.
    engine_link_lease_s: float | None = None


class Cluster:
    """Start with ``with Cluster(spec) as c:``; every process is stopped on exit."""

    def __init__(self, spec: ClusterSpec) -> None:
        self.spec = spec
        self.tmp = tempfile.mkdtemp(prefix="kvs-demo-", dir="/dev/shm")
        self.ctx = zmq.Context()
        model = load_preset(spec.model, layers=spec.layers)
        bs = spec.block_size or model.default_block_size()
        lens = [spec.max_prompt] * spec.max_requests
        self.sides: dict[str, Side] = {}
        for role, tp in (("decode", spec.decode_tp), ("prefill", spec.prefill_tp)):
            nb = blocks_needed(model, tp, bs, lens, spec.num_spec)
            params = CacheParams(
                spec.model,
                tp,
                bs,
                nb,
                layers=spec.layers,
                layout_mode=spec.layout,
                kv_layout=spec.kv_layout,
                heads_major=spec.heads_major,
                conv_layout=spec.conv_layout,
            )
            side = Side(role, tp, params, 0, 0, f"{role}-{os.getpid()}")
            side.allocator = BlockAllocator(
                preset_config(params), seed=1 if role == "decode" else 0
            )
            self.sides[role] = side
        # Sockets live in /dev/shm and go at close; logs go to disk and stay for a post-mortem.
        self.log_dir = Path(spec.log_dir or tempfile.mkdtemp(prefix="kvs-logs-"))
        self.master: MasterProcess | None = None

    # ---- processes -------------------------------------------------------------------------

    def __enter__(self) -> Cluster:
        try:
            if self.spec.pool:
                self.master = start_master(0, log_path=self.log_dir / "mooncake-master.log")
            for side in self.sides.values():
                self.start_side(side)
            for side in self.sides.values():
                self.wait_ready(side)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start_side(self, side: Side, *, same_ports: bool = False) -> None:
        """Start (or restart) one instance's sidecar and engines; ``same_ports`` restarts it
        on the ports it had, as a pod with fixed ports comes back."""
        self.start_sidecar(side, same_ports=same_ports)
        self.start_engines(side)

    def start_sidecar(self, side: Side, *, same_ports: bool = False) -> None:
        """The sidecar's settings, and its process unless the engine hosts it in-process."""
        side.ipc = f"ipc://{self.tmp}/{side.role}-engine.sock"
        # Port 0: the OS picks free ports as the sidecar binds; it writes them to its port file.
        ports = (side.control_port, side.admin_port) if same_ports else (0, 0)
        side.control_port = side.admin_port = 0
        clear_port_file(self.port_file(side))
        env = dict(os.environ)
        env.update(
            {
                "KVSIDECAR_ROLE": side.role,
                "KVSIDECAR_ENGINE_ID": side.engine_id,
                "KVSIDECAR_RANKS": ",".join(map(str, range(side.tp))),
                "KVSIDECAR_TP_SIZE": str(side.tp),
                "KVSIDECAR_MODEL": self.spec.model,
                "KVSIDECAR_CONTROL_PORT": str(ports[0]),
                "KVSIDECAR_ADMIN_PORT": str(ports[1]),
                "KVSIDECAR_PORT_FILE": str(self.port_file(side)),
                "KVSIDECAR_ENGINE_IPC": side.ipc,
                "KVSIDECAR_LOG_LEVEL": "warning",
                "MC_FORCE_TCP": "1",
                "KVSIDECAR_SEND_TIMEOUT_S": "30",
                "KVSIDECAR_RECV_TIMEOUT_S": "30",
            }
        )
        if self.master is not None:
            env.update(
                {
                    "KVSIDECAR_POOL__ENABLED": "true",
                    "KVSIDECAR_POOL__MASTER_ADDRESS": self.master.rpc_address,
                    "KVSIDECAR_POOL__GLOBAL_SEGMENT_BYTES": str(
                        self.spec.pool_segment_bytes if side.role == "prefill" else 0
                    ),
                    "KVSIDECAR_POOL__LOCAL_BUFFER_BYTES": str(16 << 20),
                }
            )
        env.update(self.spec.sidecar_env)
        env.update(self.spec.prefill_env if side.role == "prefill" else self.spec.decode_env)
        side.env = env
        if side.role in self.spec.in_process:
            side.sidecar = None
            return
        log = open(self.log_dir / f"{side.role}-sidecar.log", "ab")  # noqa: SIM115
        side.sidecar = subprocess.Popen(
            self.spec.sidecar_cmd.get(side.role, [sys.executable, "-m", "app", "serve"]),
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )

    def start_engines(self, side: Side) -> None:
        """Start the instance's engine process (every rank) against its sidecar's socket."""
        endpoint = f"ipc://{self.tmp}/{side.role}-driver.sock"
        extra = ["--link-timeout", str(self.spec.engine_link_timeout_s)]
        if self.spec.engine_link_lease_s is not None:
            extra += ["--link-lease", str(self.spec.engine_link_lease_s)]
        if self.spec.sentinel is not None and side.role == "decode":
            extra += ["--sentinel", str(self.spec.sentinel)]
        if side.role in self.spec.in_process:
            extra.append("--in-process")
        side.engines = [
            start_process(
                [
                    sys.executable,
                    "-m",
                    "app.sim.engine",
                    "--sidecar",
                    side.ipc,
                    "--driver",
                    endpoint,
                    "--engine-id",
                    side.engine_id,
                    "--ranks",
                    ",".join(map(str, range(side.tp))),
                    "--params",
                    msgspec.json.encode(side.params).decode(),
                    "--shm-prefix",
                    self.shm_prefix(side),
                    *extra,
                ],
                side.env,
                self.log_dir / f"{side.role}-engine.log",
                append=True,
            )
        ]
        side.started += [(self.shm_prefix(side), p) for p in side.engines]
        side.endpoints, side.sockets = [endpoint], []

    def restart_engines(self, side: Side, timeout: float = 120.0) -> None:
        """Kill the instance's engine process (SIGKILL, if still running) and start a new one
        behind the same live sidecar: it allocates new KV memory and registers every rank
        again. Its segments get a new generation in their names; the old ones stay in
        /dev/shm (a killed engine cannot remove them) until the cluster closes."""
        self.kill_engines(side)
        side.generation += 1
        self.start_engines(side)
        side.info = self.call(side, Command(cmd="info"), timeout)["ranks"]

    def kill_engines(self, side: Side, sig: int = signal.SIGKILL) -> None:
        """Signal the instance's engine process only; its sidecar keeps running."""
        for p in side.engines:
            if p.poll() is None:
                p.send_signal(sig)
        for p in side.engines:
            p.wait(10)
        for s in side.sockets:
            s.close(0)
        side.sockets = []

    def signal_sidecar(self, side: Side, sig: int) -> None:
        """Send ``sig`` to the instance's sidecar process (SIGKILL, SIGTERM, SIGSTOP, SIGCONT)."""
        assert side.sidecar is not None
        if side.sidecar.poll() is None:
            side.sidecar.send_signal(sig)

    def shm_prefix(self, side: Side) -> str:
        gen = f"-g{side.generation}" if side.generation else ""
        return f"{Path(self.tmp).name}-{side.role}{gen}"

    def attach(self, side: Side, rank: int, generation: int | None = None) -> RankLayout:
        """A rank's KV cache mapped from its segments in /dev/shm, for checks after its engine
        died (the segments of a killed engine outlive it)."""
        gen = side.generation if generation is None else generation
        prefix = f"{Path(self.tmp).name}-{side.role}{f'-g{gen}' if gen else ''}-r{rank}-"
        names = sorted(
            (f.name for f in Path("/dev/shm").glob(f"{prefix}*")),
            key=lambda n: int(n.rsplit("-", 1)[1]),
        )
        return allocate_rank(side.params, rank, allocator=attach_allocator(names))

    def unlink_shm(self, side: Side, prefix: str | None = None) -> None:
        """Remove a stopped instance's KV segments, every generation's (a killed engine
        cannot); ``prefix``: only those of one engine start."""
        for f in Path("/dev/shm").glob(f"{prefix or Path(self.tmp).name + '-' + side.role}-*"):
            f.unlink(missing_ok=True)

    def _socket(self, side: Side) -> zmq.Socket[bytes]:
        if not side.sockets:
            sock = self.ctx.socket(zmq.REQ)
            sock.linger = 0
            sock.setsockopt(zmq.REQ_RELAXED, 1)
            sock.setsockopt(zmq.REQ_CORRELATE, 1)
            sock.connect(side.endpoints[0])
            side.sockets.append(sock)
        return side.sockets[0]

    def port_file(self, side: Side) -> Path:
        """Where the instance's sidecar (or in-process agent) writes the ports it bound."""
        return Path(self.tmp) / f"{side.role}-ports.json"

    def wait_ready(self, side: Side, timeout: float = 180.0) -> None:
        """Wait until every rank registered and the sidecar reported its ports."""
        side.info = self.call(side, Command(cmd="info"), timeout)["ranks"]
        writer = side.sidecar or side.engines[0]

        def alive() -> None:
            if writer.poll() is not None:
                raise KVSidecarError(
                    f"the {side.role} sidecar exited with {writer.returncode} before it wrote "
                    f"its ports; see the logs in {self.log_dir}"
                )

        ports = wait_port_file(
            self.port_file(side), ("control_port", "admin_port"), 30, check=alive
        )
        side.control_port, side.admin_port = ports["control_port"], ports["admin_port"]

    def send(self, side: Side, cmd: Command) -> None:
        self._socket(side).send(msgspec.json.encode(cmd))

    def recv(self, side: Side, timeout: float) -> dict[str, Any]:
        sock = self._socket(side)
        deadline = time.monotonic() + timeout
        while not sock.poll(100):
            self._check_alive(side)
            if time.monotonic() > deadline:
                raise DeadlineExceeded(
                    f"{side.role} engines did not answer within "
                    f"{timeout:.0f}s; see its log in {self.log_dir}"
                )
        out: dict[str, Any] = msgspec.json.decode(sock.recv())
        if "error" in out:
            raise KVSidecarError(f"{side.role} engines: {out['error']}")
        return out

    def call(self, side: Side, cmd: Command, timeout: float) -> dict[str, Any]:
        self.send(side, cmd)
        return self.recv(side, timeout)

    def _check_alive(self, side: Side) -> None:
        for p in [side.sidecar, *side.engines]:
            if p is not None and p.poll() is not None and p.returncode not in (0, -9, -15):
                raise KVSidecarError(
                    f"a {side.role} process exited with status {p.returncode}; "
                    f"see the logs in {self.log_dir}"
                )

    def kill_side(self, side: Side, sig: int = signal.SIGKILL) -> None:
        for p in [*side.engines, side.sidecar]:
            if p is not None and p.poll() is None:
                p.send_signal(sig)
        for p in [*side.engines, side.sidecar]:
            if p is not None:
                p.wait(10)
        for s in side.sockets:
            s.close(0)
        side.sockets = []
        self.unlink_shm(side)

    def close(self) -> None:
        for side in self.sides.values():
            if side.sockets and side.engines and side.engines[0].poll() is None:
                with contextlib.suppress(zmq.ZMQError):
                    side.sockets[0].send(msgspec.json.encode(Command(cmd="exit")), zmq.NOBLOCK)
        for side in self.sides.values():
            for p in [*side.engines, side.sidecar]:
                if p is None or p.poll() is not None:
                    continue
                p.send_signal(signal.SIGCONT)  # a stopped process would sit on its SIGTERM
                p.send_signal(signal.SIGTERM)
        for side in self.sides.values():
            for p in [*side.engines, side.sidecar]:
                if p is None:
                    continue
                try:
                    p.wait(15)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(5)
        self.ctx.destroy(0)
        if self.master is not None:
            stop_master(self.master)
            self.master = None
        shutil.rmtree(self.tmp, ignore_errors=True)
        # What engines that were killed (or crashed) could not remove. An engine that exited
        # cleanly removed its own segments; anything of its left behind is a leak to see.
        for side in self.sides.values():
            for prefix, p in side.started:
                if p.poll() != 0:
                    self.unlink_shm(side, prefix)

    # ---- requests --------------------------------------------------------------------------

    def make_requests(
        self,
        prompt_lens: Sequence[int],
        prefix: str = "req",
        *,
        mamba_mode: MambaMode = MambaMode.NONE,
        tokens: Sequence[Sequence[int]] | None = None,
        full_decode_table: bool = False,
    ) -> list[tuple[SimRequest, SimRequest]]:
        """(prefill, decode) request pairs with block ids allocated on both instances.

        ``full_decode_table`` gives D every block of the prompt (a pool load may fill any of
        them) instead of the null block for skipped sliding-window blocks.
        """
        p, d = self.sides["prefill"], self.sides["decode"]
        assert p.allocator is not None and d.allocator is not None
        signer = target_signer(d.env)
        out = []
        for i, n in enumerate(prompt_lens):
            rid = f"{prefix}-{i}"
            toks = list(tokens[i]) if tokens is not None else []
            pb = p.allocator.allocate_request(
                n, decode=False, mamba_mode=mamba_mode, num_spec=self.spec.num_spec
            )
            db = d.allocator.allocate_request(
                n, decode=not full_decode_table, mamba_mode=mamba_mode, num_spec=self.spec.num_spec
            )
            # Signed as decode's sidecar signs what its connector posts.
            target = signer.sign(
                RemoteTarget(
                    rid,
                    "127.0.0.1",
                    d.control_port,
                    d.engine_id,
                    d.info[0]["epoch"],
                    d.tp,
                    [b.tolist() for b in db],
                    prompt_digest=prompt_digest(toks),
                )
            )
            out.append(
                (
                    SimRequest(rid, n, [b.tolist() for b in pb], target, toks),
                    SimRequest(rid, n, [b.tolist() for b in db], None, toks),
                )
            )
        return out

    def retarget(self, req: SimRequest, **changes: Any) -> None:
        """Change ``req``'s target, signed anew as decode's sidecar signs (fault tests: a
        target decode's connector got wrong, not a forged one)."""
        assert req.remote is not None
        changed = msgspec.structs.replace(req.remote, signature="", **changes)
        req.remote = target_signer(self.sides["decode"].env).sign(changed)

    def release(self, pairs: Sequence[tuple[SimRequest, SimRequest]]) -> None:
        p, d = self.sides["prefill"], self.sides["decode"]
        assert p.allocator is not None and d.allocator is not None
        for pr, dr in pairs:
            p.allocator.release([np.asarray(b) for b in pr.blocks])
            d.allocator.release([np.asarray(b) for b in dr.blocks])

    def run(
        self,
        pairs: Sequence[tuple[SimRequest, SimRequest]],
        *,
        chunk: int | None = None,
        compute_ms: float = 0.0,
        timeout_s: float = 30.0,
        bulk: bool = False,
        mamba_mode: MambaMode = MambaMode.NONE,
        fill: bool = True,
        verify: bool = True,
        poll_ms: float = 5.0,
        bulk_one_signal: bool = False,
        target_after_layers: int = -1,
        target_via_admin: bool = False,
        queued_s: float = 0.0,
    ) -> dict[str, Any]:
        """Expect at D, prefill at P (all ranks at once) ``queued_s`` later (as if the requests
        waited in prefill's queue that long), wait and verify at D.

        ``target_after_layers`` >= 0: P admits without D's target and gets it after that many
        layer signals (concurrent dispatch; past the last one, after the forward pass), through
        the engine link, or ``target_via_admin``, posted to P's admin API (prefill first)."""
        p, d = self.sides["prefill"], self.sides["decode"]
        common: dict[str, Any] = {
            "chunk": chunk,
            "compute_ms": compute_ms,
            "timeout_s": timeout_s,
            "mamba_mode": mamba_mode.value,
            "num_spec": self.spec.num_spec,
            "bulk": bulk,
            "fill": fill,
            "verify": verify,
            "poll_ms": poll_ms,
            "bulk_one_signal": bulk_one_signal,
            "prefill_tp": p.tp,
            "target_after_layers": target_after_layers,
            "target_url": f"{p.admin_url}/v1/kv_targets" if target_via_admin else None,
        }
        d_reqs = [dr for _, dr in pairs]
        expect = self.call(d, Command(cmd="expect", requests=d_reqs, **common), 30)
        time.sleep(queued_s)
        t0 = time.monotonic()
        self.send(p, Command(cmd="prefill", requests=[pr for pr, _ in pairs], **common))
        self.send(d, Command(cmd="wait", requests=d_reqs, **common))
        prefill = self.recv(p, timeout_s + 60)
        decode = self.recv(d, timeout_s + 60)
        return {"expect": expect, "prefill": prefill, "decode": decode, "started": t0}

    def untouched(
        self,
        pairs: Sequence[tuple[SimRequest, SimRequest]],
        mamba_mode: MambaMode = MambaMode.NONE,
        *,
        done: Sequence[str] | None = None,
    ) -> list[str]:
        """What decode holds outside the requests' read sets; empty when all is well.

        With a sentinel (``ClusterSpec.sentinel`` or the engines' ``sentinel`` command) every
        byte of decode's cache is compared; ``done`` names the requests that ended DONE (the
        others may have left anything in their blocks), None meaning all of them.
        """
        return self.changed_outside(pairs, mamba_mode, done=done)[1]

    def changed_outside(
        self,
        pairs: Sequence[tuple[SimRequest, SimRequest]],
        mamba_mode: MambaMode = MambaMode.NONE,
        *,
        done: Sequence[str] | None = None,
    ) -> tuple[int, list[str]]:
        """``untouched`` with the number of bytes changed (0 without a sentinel)."""
        cmd = Command(
            cmd="untouched",
            requests=[dr for _, dr in pairs],
            mamba_mode=mamba_mode.value,
            num_spec=self.spec.num_spec,
            done=None if done is None else list(done),
        )
        out = self.call(self.sides["decode"], cmd, 60)
        return int(out.get("changed", 0)), list(out["problems"])
