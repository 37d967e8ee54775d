"""Constants and value checks the settings share: env var names, limits, hosts, sizes."""

from __future__ import annotations

import difflib
import ipaddress
import os
import re
import socket
from importlib import resources

ENV_PREFIX = "KVSIDECAR_"
ENV_NESTED_DELIMITER = "__"
CONFIG_ENV_VAR = f"{ENV_PREFIX}CONFIG"

# DESIGN §6: 4096 descriptors in one batch were rejected ("TCP lane queue-full") and poisoned the
# engine's session to that peer; 2048 passed. 1024 leaves headroom below the last size seen to work.
MAX_DESCRIPTORS_HARD_LIMIT = 2048
DEFAULT_DESCRIPTORS_PER_SUBMIT = 1024

# Deadlines are in seconds; an hour catches a value meant as milliseconds.
_MAX_DEADLINE_S = 3600.0

_HOSTNAME_RE = re.compile(
    r"^(?=.{1,253}$)[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
    r"(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*$"
)
_ENGINE_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")
_PRESET_RE = re.compile(r"^[a-z0-9][a-z0-9._-]*$")
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_SIZE_POWERS = {"": 0, "K": 1, "M": 2, "G": 3, "T": 4}


def env_var_for(setting: str) -> str:
    """Environment variable of a setting; ``pool.enabled`` -> ``KVSIDECAR_POOL__ENABLED``."""
    return ENV_PREFIX + ENV_NESTED_DELIMITER.join(part.upper() for part in setting.split("."))


def _default_engine_id() -> str:
    # In a pod the host name is the pod name: unique per instance and readable in /v1/peers.
    return socket.gethostname() or "kv-sidecar"


def _check_host(value: str) -> str:
    value = value.strip()
    if value.startswith("[") and value.endswith("]"):
        value = value[1:-1]
    try:
        ipaddress.ip_address(value)
    except ValueError:
        if not _HOSTNAME_RE.match(value):
            raise ValueError(
                "must be an IP address or a host name without scheme or port, "
                "e.g. 127.0.0.1 (this host only) or 0.0.0.0 (every interface)"
            ) from None
    return value


def _parse_size(value: object) -> object:
    """Accept byte counts as integers or as strings like ``512MiB`` / ``4GB`` / ``1.5G``."""
    if not isinstance(value, str):
        return value
    match = _SIZE_RE.match(value)
    if match is None:
        raise ValueError("must be a byte count such as 1073741824, 1GiB or 512MB")
    unit = (match.group(2) or "").upper().removesuffix("B")
    binary = unit.endswith("I")
    power = _SIZE_POWERS[unit.removesuffix("I")]
    return int(float(match.group(1)) * (1024 if binary else 1000) ** power)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _is_wildcard(host: str) -> bool:
    return host in ("0.0.0.0", "::", "")


def available_presets() -> list[str]:
    """Names of the model presets shipped as package data (empty until they ship)."""
    try:
        folder = resources.files("app.kvcache").joinpath("presets")
        if not folder.is_dir():
            return []
        return sorted(
            entry.name.removesuffix(".json")
            for entry in folder.iterdir()
            if entry.name.endswith(".json")
        )
    except (ModuleNotFoundError, OSError):
        return []


def unknown_env_vars(known: set[str]) -> list[str]:
    """A note for each ``KVSIDECAR_`` variable that names no setting: pydantic-settings ignores
    unknown variables, so a typo there would otherwise go unseen."""
    known = known | {CONFIG_ENV_VAR}
    notes = []
    for var in sorted(os.environ):
        if var.upper().startswith(ENV_PREFIX) and var.upper() not in known:
            close = difflib.get_close_matches(var.upper(), sorted(known), n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            notes.append(f"{var} is not a kv-sidecar setting and is ignored{hint}.")
    return notes
