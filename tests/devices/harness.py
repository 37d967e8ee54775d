"""A real P/D pair for the device tests: two sidecar processes (``python -m app serve``, Mooncake
over loopback TCP) and their engines' links in the test process, so that a test holds the
engine side itself (its events, its KV memory) and reads decode's KV directly."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import pytest

from app.devices.base import available
from app.engine_link.client import EngineLink, FinishedRequests
from app.kvcache.layout import RankLayout
from app.ports import clear_port_file, wait_port_file
from app.sim.ranks import CacheParams, SimKV, register_rank
from app.transfer.wire.protocol import FailedRequest, RemoteTarget
from app.transfer.wire.target_auth import prompt_digest

# Two layers of Llama 3.1 8B: 64 KiB per 16-token block and layer, one full-attention group.
PARAMS = CacheParams("llama-3.1-8b", 1, 16, 32, layers=2, events=True)
PAGE = 16 * 8 * 128 * 2 * 2  # bytes of one block of one layer (tokens x heads x hd x K/V x bf16)
SEND_TIMEOUT_S = 4.0


def require_device(kind: str) -> None:
    """Skip the calling test, saying why, unless this machine has a ``kind`` device."""
    if not available(kind):
        what = "torch.cuda.is_available() is False" if kind == "cuda" else "no torch_npu / NPU"
        pytest.skip(f"needs a {kind} device; {what} on this machine")


def require_device_mooncake() -> None:
    """Mooncake over TCP reads and writes device memory only in its CUDA build."""
    try:
        importlib.metadata.version("mooncake-transfer-engine")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip(
            "needs the CUDA build of Mooncake (pip install '.[mooncake-cuda]'); the non-cuda "
            "wheel cannot move device memory"
        )


class LateEvent:
    """A device event stand-in that completes when the test says so."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self.synchronized = 0  # how many times someone waited on it

    def record(self) -> None:
        return None

    def synchronize(self) -> None:
        self.synchronized += 1
        self._done.wait()

    def query(self) -> bool:
        return self._done.is_set()

    def complete(self) -> None:
        self._done.set()


@dataclass
class Side:
    role: str
    engine_id: str
    ipc: str
    control_port: int  # 0 until _connect read the sidecar's port file
    log: Path
    proc: subprocess.Popen[bytes]
    link: EngineLink | None = None
    port_file: Path | None = None
    kv: SimKV | None = None  # the engine's KV memory, held by the test


@dataclass
class Pair:
    """Started by ``start_pair``; ``close`` stops every process."""

    prefill: Side
    decode: Side
    params: CacheParams
    send_timeout_s: float
    seen: dict[str, FailedRequest | str] = field(default_factory=dict)

    @property
    def p(self) -> EngineLink:
        assert self.prefill.link is not None
        return self.prefill.link

    @property
    def d(self) -> EngineLink:
        assert self.decode.link is not None
        return self.decode.link

    @property
    def p_layout(self) -> RankLayout:
        assert self.prefill.kv is not None
        return self.prefill.kv.layout

    @property
    def d_layout(self) -> RankLayout:
        assert self.decode.kv is not None
        return self.decode.kv.layout

    def send(
        self,
        rid: str,
        prompt_len: int,
        p_blocks: Sequence[np.ndarray] | Sequence[Sequence[int]],
        d_blocks: Sequence[np.ndarray],
    ) -> None:
        """Admit ``rid`` at prefill with decode's target, both for a prompt of ``prompt_len``
        tokens (``0..prompt_len-1``: the digest the target binds)."""
        digest = prompt_digest(range(prompt_len))
        target = self.target(d_blocks, rid, digest)
        self.p.add_send_request(rid, prompt_len, p_blocks, target, prompt_digest=digest)

    def target(self, d_blocks: Sequence[np.ndarray], rid: str, digest: str = "") -> RemoteTarget:
        """Decode's target for ``rid`` and the prompt whose digest is ``digest``, signed by
        decode's sidecar as its connector has it."""
        (signed,) = self.d.sign_targets(
            [
                RemoteTarget(
                    request_id=rid,
                    host="127.0.0.1",
                    port=self.decode.control_port,
                    engine_id=self.decode.engine_id,
                    epoch=self.d.epoch,
                    tp_size=1,
                    block_ids=[b.tolist() for b in d_blocks],
                    prompt_digest=digest,
                )
            ]
        )
        return signed

    def poll(self, link: EngineLink) -> FinishedRequests:
        """One ``get_finished``, remembering what ended (each end is reported once)."""
        fin = link.get_finished()
        for rid in [*fin.sending, *fin.recving]:
            self.seen[rid] = "DONE"
        for f in fin.failed:
            self.seen[f.request] = f
        return fin

    def wait_end(self, link: EngineLink, rid: str, timeout_s: float) -> FailedRequest | str:
        deadline = time.monotonic() + timeout_s
        while rid not in self.seen:
            if time.monotonic() > deadline:
                raise AssertionError(f"request {rid} did not end within {timeout_s}s")
            self.poll(link)
            time.sleep(0.02)
        return self.seen.pop(rid)

    def close(self) -> None:
        for side in (self.prefill, self.decode):
            if side.link is not None:
                side.link.close()
            if side.kv is not None:
                side.kv.close()
            if side.proc.poll() is None:
                side.proc.terminate()
        for side in (self.prefill, self.decode):
            try:
                side.proc.wait(10)
            except subprocess.TimeoutExpired:
                side.proc.kill()
                side.proc.wait(10)


def _start_sidecar(
    role: str,
    sock_dir: Path,
    log_dir: Path,
    params: CacheParams,
    send_timeout_s: float,
    env: dict[str, str],
) -> Side:
    engine_id = f"{role}-{os.getpid()}-{sock_dir.name}"
    ipc = f"ipc://{sock_dir}/{role}-engine.sock"
    # Port 0: the sidecar binds free ports and reports them in its port file (read in _connect).
    port_file = sock_dir / f"{role}-ports.json"
    clear_port_file(port_file)
    full = dict(os.environ)
    full.update(
        {
            "KVSIDECAR_ROLE": role,
            "KVSIDECAR_ENGINE_ID": engine_id,
            "KVSIDECAR_RANKS": "0",
            "KVSIDECAR_TP_SIZE": "1",
            "KVSIDECAR_MODEL": params.model,
            "KVSIDECAR_CONTROL_PORT": "0",
            "KVSIDECAR_ADMIN_PORT": "0",
            "KVSIDECAR_PORT_FILE": str(port_file),
            "KVSIDECAR_ENGINE_IPC": ipc,
            "KVSIDECAR_LOG_LEVEL": "warning",
            "MC_FORCE_TCP": "1",
            "KVSIDECAR_SEND_TIMEOUT_S": str(send_timeout_s),
            "KVSIDECAR_RECV_TIMEOUT_S": "30",
        }
    )
    full.update(env)
    log = log_dir / f"{role}-sidecar.log"
    with log.open("ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "app", "serve"], env=full, stdout=out, stderr=subprocess.STDOUT
        )
    return Side(role, engine_id, ipc, 0, log, proc, port_file=port_file)


def _connect(side: Side, params: CacheParams, timeout_s: float = 120.0) -> None:
    """Wait for the sidecar's engine socket, then allocate and register rank 0."""
    _wait_ready(side, timeout_s)
    prefix = f"kvs-dev-{side.role}-{os.getpid()}-{id(side) % 100000}"
    side.link = EngineLink(side.ipc, side.engine_id, 0, shm_prefix=prefix)
    side.kv = register_rank(side.link, params)


def restart_sidecar(pair: Pair, role: str, timeout_s: float = 120.0) -> None:
    """A new sidecar process for ``role`` on the same engine socket, the old one killed (if it
    still runs); the engine's link and memory stay as they are (it has to register again)."""
    side = pair.prefill if role == "prefill" else pair.decode
    if side.proc.poll() is None:
        side.proc.kill()
    side.proc.wait(10)
    params = pair.params if role == "prefill" else replace(pair.params, events=False)
    sock_dir = Path(side.ipc.removeprefix("ipc://")).parent
    new = _start_sidecar(role, sock_dir, side.log.parent, params, pair.send_timeout_s, {})
    side.proc, side.control_port = new.proc, 0
    _wait_ready(side, timeout_s)


def _wait_ready(side: Side, timeout_s: float) -> None:
    """Until the sidecar's engine socket exists and its port file names its control port."""
    sock = Path(side.ipc.removeprefix("ipc://"))
    deadline = time.monotonic() + timeout_s
    while not sock.exists():
        if side.proc.poll() is not None or time.monotonic() > deadline:
            tail = side.log.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"{side.role} sidecar did not start; its log ends:\n{tail}")
        time.sleep(0.1)
    if side.port_file is not None:

        def alive() -> None:
            if side.proc.poll() is not None:
                tail = side.log.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"{side.role} sidecar exited; its log ends:\n{tail}")

        ports = wait_port_file(side.port_file, ("control_port",), timeout_s, check=alive)
        side.control_port = ports["control_port"]


def start_pair(
    sock_dir: Path,
    log_dir: Path,
    params: CacheParams,
    *,
    send_timeout_s: float = 4.0,
    env: dict[str, str] | None = None,
) -> Pair:
    """Decode registers first (prefill's handshake needs it ready); prefill gets ``params``
    (with its event ring when ``params.events``), decode the same without a ring."""
    extra = env or {}
    d_params = CacheParams(**{**params.__dict__, "events": False})
    decode = _start_sidecar("decode", sock_dir, log_dir, d_params, send_timeout_s, extra)
    prefill = _start_sidecar("prefill", sock_dir, log_dir, params, send_timeout_s, extra)
    pair = Pair(prefill, decode, params, send_timeout_s)
    try:
        _connect(decode, d_params)
        _connect(prefill, params)
    except BaseException:
        pair.close()
        raise
    return pair
