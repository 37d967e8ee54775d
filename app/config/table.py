"""The settings table of the README (``python -m app.config`` prints it as Markdown)."""

from __future__ import annotations

from pydantic.fields import FieldInfo

from app.config.pool import PoolSettings
from app.config.schema import SidecarSettings
from app.config.values import env_var_for

# Defaults that are computed at start; the table shows what they mean, not this host's value.
_TABLE_DEFAULTS = {"engine_id": "host name"}


def _table_default(name: str, info: FieldInfo) -> str:
    if name in _TABLE_DEFAULTS:
        return _TABLE_DEFAULTS[name]
    value = info.get_default(call_default_factory=True)
    if value is None:
        return "(unset)"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return ",".join(str(v) for v in value)
    return str(value) if value != "" else "(empty)"


def settings_table() -> list[tuple[str, str, str, str]]:
    """(setting, env var, default, description) for every setting, pool settings as pool.x."""
    rows: list[tuple[str, str, str, str]] = []
    for name, info in SidecarSettings.model_fields.items():
        if name == "pool":
            for sub, sub_info in PoolSettings.model_fields.items():
                key = f"pool.{sub}"
                rows.append(
                    (
                        key,
                        env_var_for(key),
                        _table_default(sub, sub_info),
                        sub_info.description or "",
                    )
                )
            continue
        rows.append((name, env_var_for(name), _table_default(name, info), info.description or ""))
    return rows


def render_settings_table() -> str:
    """The settings table as Markdown, for the README."""
    lines = ["| setting | env var | default | description |", "|---|---|---|---|"]
    for setting, env, default, description in settings_table():
        lines.append(f"| `{setting}` | `{env}` | `{default}` | {description} |")
    return "\n".join(lines)
