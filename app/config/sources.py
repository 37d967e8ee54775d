"""Where settings come from besides flags and env: the TOML / JSON config file."""

from __future__ import annotations

import json
import os
import tomllib
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Any

from pydantic.fields import FieldInfo
from pydantic_settings import (
    BaseSettings,
    InitSettingsSource,
    PydanticBaseSettingsSource,
)

from app.config.values import CONFIG_ENV_VAR
from app.errors import ConfigError

# Sentinel for "no explicit path given": fall back to KVSIDECAR_CONFIG.
_FROM_ENV = Path("\0from-env")
_config_path: ContextVar[Path | None] = ContextVar("kvsidecar_config_path", default=_FROM_ENV)


class _ConfigFileSource(PydanticBaseSettingsSource):
    """Settings from a TOML or JSON file: the explicit path, else ``KVSIDECAR_CONFIG``."""

    def __init__(self, settings_cls: type[BaseSettings]) -> None:
        super().__init__(settings_cls)
        path = _config_path.get()
        if path == _FROM_ENV:
            env = os.environ.get(CONFIG_ENV_VAR, "").strip()
            path = Path(env) if env else None
        self.path = path
        self.data = read_config_file(path) if path is not None else {}

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return self.data.get(field_name), field_name, False

    def __call__(self) -> dict[str, Any]:
        # Reuse the init source so that the file's keys are matched exactly like flags are.
        return InitSettingsSource(self.settings_cls, init_kwargs=self.data)()


def read_config_file(path: Path) -> dict[str, Any]:
    """Read a settings file (TOML or JSON by suffix) into a dict, or raise ConfigError."""
    suffix = path.suffix.lower()
    if suffix not in (".toml", ".json"):
        raise ConfigError(
            f"Config file {path} has suffix {suffix or '(none)'!r}: use a .toml or .json file "
            f"(given by --config or {CONFIG_ENV_VAR})."
        )
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ConfigError(
            f"Config file {path} cannot be read ({exc.strerror or exc}); fix the path given "
            f"by --config or {CONFIG_ENV_VAR}, or unset it."
        ) from None
    try:
        data = tomllib.loads(raw.decode()) if suffix == ".toml" else json.loads(raw)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"Config file {path} is not valid {suffix[1:].upper()}: {exc}.") from None
    if not isinstance(data, dict):
        raise ConfigError(f"Config file {path} must hold a table of settings at the top level.")
    return data


@contextmanager
def _using_config_file(path: Path | None) -> Iterator[None]:
    token = _config_path.set(_FROM_ENV if path is None else path)
    try:
        yield
    finally:
        _config_path.reset(token)
