"""Which weights computed a KV cache: the checkpoint's identity, for the pool's keys.

A pool object is only as right as the weights that computed it. The architecture (``model_type``
and layer shapes) is not enough: Llama-3.1-8B and its Instruct variant, or a weight update rolled
out against the same Mooncake master, share every shape. So the identity names the model as vLLM
resolved it (path or name, revision), the dtypes that decide the KV bytes (model dtype,
quantization, KV-cache dtype, Mamba state dtypes) and a fingerprint of the weights themselves.

Safetensors headers are not enough either (two random checkpoints of one architecture have equal
headers), so the fingerprint hashes every tensor's name, dtype and shape together with a small
sample of its bytes (its first, middle and last 64 bytes): a few reads a tensor, milliseconds for
a large checkpoint, and any retrained or updated weight matrix changes it. Other weight files
(``.bin``, ``.pt``, ``.gguf``) are fingerprinted by size and sampled bytes. Weights that vLLM
makes up (``load_format=dummy``) have no files; their identity says so.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import struct
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

_SAMPLE = 64
_OTHER_WEIGHTS = (".bin", ".pt", ".pth", ".gguf")


def checkpoint_identity(vllm_config: Any) -> str:
    """A 32-hex-digit digest of the checkpoint and the dtypes that decide the KV's bytes."""
    m = vllm_config.model_config
    cache = vllm_config.cache_config
    load = vllm_config.load_config
    parts = {
        "model": str(m.model),
        "revision": str(m.revision or ""),
        "dtype": str(m.dtype),
        "quantization": str(m.quantization or ""),
        "kv_cache_dtype": str(cache.cache_dtype),
        "mamba_cache_dtype": str(getattr(cache, "mamba_cache_dtype", "")),
        "mamba_ssm_cache_dtype": str(getattr(cache, "mamba_ssm_cache_dtype", "")),
        "hf_overrides": repr(getattr(m, "hf_overrides", None) or ""),
        "load_format": str(load.load_format),
        "weights": _weights(str(m.model), m.revision, str(load.load_format)),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]


def _weights(model: str, revision: str | None, load_format: str) -> str:
    if load_format == "dummy":
        return "dummy"  # vLLM's made-up weights: no checkpoint to fingerprint
    directory = _local_dir(model, revision)
    if directory is None:
        log.warning(
            "model %s: its weight files were not found locally; the KV pool's keys name it by "
            "name and revision only (set pool.namespace per weight version)",
            model,
        )
        return "unresolved"
    return weights_fingerprint(directory)


def _local_dir(model: str, revision: str | None) -> Path | None:
    if os.path.isdir(model):
        return Path(model)
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, revision=revision, local_files_only=True))
    except Exception:  # not in the local cache, or no hub client: identity by name only
        return None


@functools.lru_cache(maxsize=8)
def weights_fingerprint(directory: Path) -> str:
    """The fingerprint of the weight files in ``directory`` (see the module's docstring)."""
    h = hashlib.sha256()
    files = sorted(p for p in directory.iterdir() if p.suffix in (".safetensors", *_OTHER_WEIGHTS))
    for path in files:
        h.update(path.name.encode() + b"\0")
        with path.open("rb") as f:
            if path.suffix == ".safetensors":
                _safetensors(f, h)
            else:
                _sampled(f, 0, path.stat().st_size, h)
    return h.hexdigest()[:32] if files else "no-weight-files"


def _safetensors(f: Any, h: Any) -> None:
    (header_len,) = struct.unpack("<Q", f.read(8))
    header = json.loads(f.read(header_len))
    base = 8 + header_len
    for name in sorted(k for k in header if k != "__metadata__"):
        t = header[name]
        begin, end = t["data_offsets"]
        h.update(json.dumps([name, t["dtype"], t["shape"]]).encode())
        _sampled(f, base + begin, end - begin, h)


def _sampled(f: Any, start: int, size: int, h: Any) -> None:
    """The first, middle and last ``_SAMPLE`` bytes of ``size`` bytes from ``start``."""
    h.update(struct.pack("<Q", size))
    for at in sorted({0, max(0, size // 2 - _SAMPLE // 2), max(0, size - _SAMPLE)}):
        f.seek(start + at)
        h.update(f.read(min(_SAMPLE, size)))
