"""Building the settings from flags, env and file, and the sentences that say what is wrong."""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import (
    ValidationError,
)
from pydantic_settings.exceptions import SettingsError

from app.config.schema import SidecarSettings, _known_settings
from app.config.sources import _using_config_file
from app.config.values import ENV_NESTED_DELIMITER, env_var_for
from app.errors import ConfigError


def _setting_name(loc: tuple[int | str, ...]) -> tuple[str, str]:
    """Split a pydantic error location into (setting, rest): ('ranks', 1) -> ('ranks', '[1]')."""
    parts = [str(p) for p in loc]
    if parts and parts[0] == "pool" and len(parts) > 1:
        setting, rest = f"pool.{parts[1]}", parts[2:]
    else:
        setting, rest = (parts[0] if parts else ""), parts[1:]
    return setting, "".join(f"[{p}]" for p in rest)


def _sentence(text: str) -> str:
    text = text.strip()
    return text if text.endswith((".", "?", "!")) else text + "."


def _shown(setting: str, value: object) -> str:
    if setting in ("admin_token", "auth_key"):
        return "(hidden)"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def format_settings_error(exc: ValidationError) -> str:
    """One sentence per problem, each naming the setting, its env var and what is allowed."""
    sentences: list[str] = []
    known = _known_settings()
    for err in exc.errors(include_url=False):
        setting, item = _setting_name(err["loc"])
        message = str(err["msg"]).removeprefix("Value error, ")
        if not setting:
            sentences.extend(_sentence(line) for line in message.splitlines() if line.strip())
            continue
        if err["type"] == "extra_forbidden":
            close = difflib.get_close_matches(setting, known, n=1)
            hint = f"; did you mean {close[0]!r} ({env_var_for(close[0])})?" if close else ""
            sentences.append(
                _sentence(
                    f"{setting!r} (from a CLI flag or the config file) is not a kv-sidecar "
                    f"setting{hint}"
                )
            )
            continue
        allowed = message[0].lower() + message[1:] if message else "is not allowed"
        sentences.append(
            _sentence(
                f"Setting {setting}{item} ({env_var_for(setting)}) = "
                f"{_shown(setting, err.get('input'))} is not allowed: {allowed}"
            )
        )
    count = len(sentences)
    header = f"Invalid kv-sidecar settings ({count} problem{'s' if count != 1 else ''}):"
    return "\n".join([header, *(f"  - {s}" for s in sentences)])


def _nest(overrides: Mapping[str, Any]) -> dict[str, Any]:
    """Drop unset (None) flags and turn ``pool.x`` / ``pool__x`` keys into nested dicts."""
    nested: dict[str, Any] = {}
    for key, value in overrides.items():
        if value is None:
            continue
        parts = key.replace(ENV_NESTED_DELIMITER, ".").replace("-", "_").split(".")
        target = nested
        for part in parts[:-1]:
            target = target.setdefault(part, {})
        if isinstance(value, Mapping) and isinstance(target.get(parts[-1]), dict):
            target[parts[-1]].update(value)
        else:
            target[parts[-1]] = dict(value) if isinstance(value, Mapping) else value
    return nested


def load_settings(
    cli_overrides: Mapping[str, Any] | None = None, config_path: Path | str | None = None
) -> SidecarSettings:
    """Build the settings: CLI flags > KVSIDECAR_* env > config file > defaults.

    ``config_path`` wins over ``KVSIDECAR_CONFIG``. Every problem becomes a ConfigError whose
    message has one sentence per problem.
    """
    path = Path(config_path) if config_path is not None else None
    with _using_config_file(path):
        try:
            return SidecarSettings(**_nest(cli_overrides or {}))
        except ValidationError as exc:
            raise ConfigError(format_settings_error(exc)) from None
        except SettingsError as exc:
            # Raised for an env value that is not valid JSON for a structured setting.
            match = re.search(r'field "([^"]+)"', str(exc))
            field = match.group(1) if match else "?"
            raise ConfigError(
                f"Invalid kv-sidecar settings (1 problem):\n  - {env_var_for(field)} is not valid "
                f"JSON for the setting {field}; set its parts one variable each instead, e.g. "
                f"{env_var_for('pool.enabled')}=true."
            ) from None
