"""Typed settings of `kv-sidecar serve`: one object built from flags, env, a file and defaults.

Precedence, highest first:

1. CLI flags: the ``cli_overrides`` mapping given to :func:`load_settings` (``None`` values are
   dropped, so an option the user did not pass never hides the layers below it);
2. ``KVSIDECAR_*`` environment variables (nested pool settings use ``__``:
   ``KVSIDECAR_POOL__MASTER_ADDRESS``; lists take ``0,1`` or JSON ``[0, 1]``);
3. the config file: the explicit ``config_path`` or else ``KVSIDECAR_CONFIG``, TOML (``.toml``)
   or JSON (``.json``), keys named as the settings, the pool as a ``[pool]`` table;
4. the defaults below.

Every problem is reported at start as one sentence naming the setting, its environment variable
and what is allowed (:class:`app.errors.ConfigError`); :func:`settings_table` feeds the README's
configuration table (``python -m app.config`` prints it as Markdown).

The package: ``values`` (names, limits, value checks), ``sources`` (the config file), ``schema``
(the settings), ``pool`` (their ``[pool]`` table), ``loading`` (``load_settings`` and its error
sentences), ``table`` (the README table).
"""

from app.config.loading import format_settings_error, load_settings
from app.config.pool import PoolSettings
from app.config.schema import SidecarSettings
from app.config.sources import read_config_file
from app.config.table import render_settings_table, settings_table
from app.config.values import (
    CONFIG_ENV_VAR,
    DEFAULT_DESCRIPTORS_PER_SUBMIT,
    ENV_NESTED_DELIMITER,
    ENV_PREFIX,
    MAX_DESCRIPTORS_HARD_LIMIT,
    available_presets,
    env_var_for,
)

__all__ = [
    "CONFIG_ENV_VAR",
    "DEFAULT_DESCRIPTORS_PER_SUBMIT",
    "ENV_NESTED_DELIMITER",
    "ENV_PREFIX",
    "MAX_DESCRIPTORS_HARD_LIMIT",
    "PoolSettings",
    "SidecarSettings",
    "available_presets",
    "env_var_for",
    "format_settings_error",
    "load_settings",
    "read_config_file",
    "render_settings_table",
    "settings_table",
]
