"""One instance of the simulated cluster (``cluster``): its sidecar and engine processes, the
driver's sockets to its engines, its block allocator, and the signer its sidecar signs targets
with."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq

from app.config.values import env_var_for
from app.harness.zygote import ChildProcess
from app.sim.ranks import CacheParams
from app.sim.reference import BlockAllocator
from app.transfer.wire.auth import read_key_file, user_key
from app.transfer.wire.target_auth import TargetSigner


def target_signer(env: dict[str, str]) -> TargetSigner:
    """The target signer of a sidecar started with ``env`` (its control-plane key)."""
    if path := env.get(env_var_for("auth_key_file")):
        return TargetSigner(read_key_file(Path(path)))
    if key := env.get(env_var_for("auth_key")):
        return TargetSigner(key.strip().encode())
    return TargetSigner(user_key())


@dataclass
class Side:
    """One instance: its sidecar process, engine processes and driver sockets."""

    role: str
    tp: int
    params: CacheParams
    control_port: int  # 0 until its sidecar reported the port it bound (wait_ready)
    admin_port: int
    engine_id: str
    sidecar: subprocess.Popen[bytes] | None = None
    engines: list[ChildProcess] = field(default_factory=list)
    sockets: list[zmq.Socket[bytes]] = field(default_factory=list)
    endpoints: list[str] = field(default_factory=list)
    info: list[dict[str, Any]] = field(default_factory=list)
    ipc: str = ""
    env: dict[str, str] = field(default_factory=dict)
    allocator: BlockAllocator | None = None
    generation: int = 0  # engine starts behind this sidecar; names the KV segments
    # (segment name prefix, engine process) of every engine started, for the clean-up
    started: list[tuple[str, ChildProcess]] = field(default_factory=list)

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"
