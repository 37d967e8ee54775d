"""What a ``bench pd`` trial holds besides time, from ``/proc``: each sidecar's peak resident
memory, the /dev/shm a system's processes hold, how long decode's blocks stay pinned; and the
handoff (TTFT less the time before and during P's forward).

- ``handoff_ms``: TTFT − P's start delay − P's forward (``p_prefill_ms``): from P's forward
  done to the first token at the client, i.e. what disaggregation adds on top of one engine.
- ``sidecar_p_peak_rss_mib``, ``sidecar_d_peak_rss_mib`` (kv-sidecar): the peak resident set
  of P's and D's sidecar (each with its children) during the trial: ``VmHWM`` after the
  kernel's peak was reset at the trial's start (``clear_refs`` 5).
- ``shm_mib``: the /dev/shm files the system's processes map or hold open at the trial's end,
  unlinked ones too, by the blocks they use (tmpfs allocates on touch): vLLM's queues, and
  with kv-sidecar the engines' KV caches (torch shared tensors the sidecars map: not a copy).
- ``pinned_ms`` (kv-sidecar): the longest of D sidecar's receive records, created (D's
  connector registered the blocks it allocated) → ended. Mooncake's D gets the request after
  P's answer, so its blocks are pinned for about ``exposed_ms``; no record of it is kept.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from app.bench.core.cores import descendants
from app.bench.core.systems import SIDECAR_PROCESSES, System
from app.bench.core.trial import run_trial
from app.harness.proc_tree import SHM_DIR

NAN = float("nan")
MIB = 2**20


def reset_peak_rss(pids: Iterable[int], proc: Path = Path("/proc")) -> None:
    """Reset the kernel's peak resident set (``VmHWM``) of ``pids`` to their current one; a
    process gone or not ours is skipped (its peak then reads NaN or from its start)."""
    for pid in pids:
        try:
            (proc / str(pid) / "clear_refs").write_text("5")
        except OSError:
            continue


def peak_rss_bytes(pids: Iterable[int], proc: Path = Path("/proc")) -> float:
    """The sum of ``VmHWM`` over ``pids`` (a sidecar and its children); NaN where none could
    be read."""
    total, seen = 0, False
    for pid in pids:
        try:
            text = (proc / str(pid) / "status").read_text()
        except OSError:
            continue
        for line in text.splitlines():
            if line.startswith("VmHWM:"):
                total += int(line.split()[1]) * 1024  # "VmHWM:   1234 kB"
                seen = True
    return float(total) if seen else NAN


def _shm_held(pid: int, proc: Path) -> dict[tuple[int, int], int]:
    """``(dev, inode)`` → bytes used of every /dev/shm file ``pid`` maps or holds open,
    unlinked ones too (torch's shared tensors, the engines' KV caches here, are unlinked once
    mapped, and use /dev/shm until the last mapping goes)."""
    out: dict[tuple[int, int], int] = {}
    base = proc / str(pid)
    for line in (base / "maps").read_text().splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) == 6 and parts[5].startswith(SHM_DIR):
            start, end = parts[0].split("-")
            try:  # the file itself (root may read map_files): its blocks in use
                st = os.stat(base / "map_files" / parts[0])
                out[(st.st_dev, st.st_ino)] = st.st_blocks * 512
            except OSError:  # else the mapping's length
                major, minor = (int(x, 16) for x in parts[3].split(":"))
                key = (os.makedev(major, minor), int(parts[4]))
                out.setdefault(key, int(end, 16) - int(start, 16))
    for fd in (base / "fd").iterdir():
        try:
            if os.readlink(fd).startswith(SHM_DIR):
                st = os.stat(fd)
                out[(st.st_dev, st.st_ino)] = st.st_blocks * 512
        except OSError:  # closed meanwhile
            continue
    return out


def shm_bytes(pids: Iterable[int], proc: Path = Path("/proc")) -> int:
    """Bytes of /dev/shm used by the files ``pids`` map or hold open, each file once."""
    held: dict[tuple[int, int], int] = {}
    for pid in pids:
        try:
            held |= _shm_held(pid, proc)
        except OSError:  # gone, or not readable
            continue
    return sum(held.values())


def pinned_ms(records: Sequence[Mapping[str, Any]]) -> float:
    """The longest receive record's life, created → ended, in ms; NaN with none."""
    spans = [
        float(r["ended_at"]) - float(r["created_at"])
        for r in records
        if r.get("side") == "recv"
        and r.get("created_at") is not None
        and r.get("ended_at") is not None
    ]
    return 1e3 * max(spans) if spans else NAN


def handoff_ms(trial: Mapping[str, Any]) -> float:
    """TTFT less P's start delay and P's forward."""
    return float(trial["ttft_ms"]) - float(trial["p_start_ms"]) - float(trial["p_prefill_ms"])


def footprint(
    trial: Mapping[str, Any],
    sidecars: Mapping[str, Sequence[int]] | None,
    system_pids: Iterable[int],
) -> dict[str, float]:
    """A trial's footprint figures; ``sidecars`` (``{"p": pids, "d": pids}``, None for a
    system without): their peaks, reset at the trial's start by ``reset_peak_rss``."""
    peaks = {k: peak_rss_bytes(v) / MIB for k, v in (sidecars or {}).items()}
    return {
        "handoff_ms": handoff_ms(trial),
        "sidecar_p_peak_rss_mib": peaks.get("p", NAN),
        "sidecar_d_peak_rss_mib": peaks.get("d", NAN),
        "shm_mib": shm_bytes(system_pids) / MIB,
        "pinned_ms": pinned_ms(trial.get("transfer_records") or ()),
    }


def sidecar_pids(system: System) -> dict[str, list[int]] | None:
    """P's and D's sidecar, each with its children; None for a system without sidecars."""
    names = {"p": SIDECAR_PROCESSES[0], "d": SIDECAR_PROCESSES[1]}
    if not all(n in system.pd.procs for n in names.values()):
        return None
    return {k: descendants([system.pd.procs[n].pid]) for k, n in names.items()}


def measured_trial(
    system: System,
    prompts: Sequence[list[int]],
    refs: Sequence[Mapping[str, list[int]]],
    max_tokens: int,
) -> dict[str, Any]:
    """``core.trial.run_trial`` with the footprint figures joined."""
    sidecars = sidecar_pids(system)
    reset_peak_rss(p for pids in (sidecars or {}).values() for p in pids)
    r = run_trial(system, prompts, refs, max_tokens)
    every = descendants(p.pid for p in system.pd.procs.values())
    return r | footprint(r, sidecars, every)
