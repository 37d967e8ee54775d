"""SidecarSettings: defaults, the CLI > env > file > defaults precedence, errors as sentences."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import get_args

import pytest

from app.config import (
    CONFIG_ENV_VAR,
    MAX_DESCRIPTORS_HARD_LIMIT,
    PoolSettings,
    SidecarSettings,
    env_var_for,
    load_settings,
    render_settings_table,
    settings_table,
)
from app.errors import ConfigError


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The developer's own KVSIDECAR_* variables must not leak into these tests."""
    for var in list(os.environ):
        if var.upper().startswith("KVSIDECAR_"):
            monkeypatch.delenv(var)


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def _problems(message: str) -> list[str]:
    return [line.removeprefix("  - ") for line in message.splitlines() if line.startswith("  - ")]


# --- defaults ------------------------------------------------------------------------------


def test_defaults() -> None:
    s = load_settings()
    assert s.role == "both"
    assert s.engine_id == socket.gethostname()
    assert s.ranks == [0]
    assert s.tp_size == 1
    assert s.model == "llama-3.1-8b"
    assert s.layers is None
    assert s.layout_mode == "per_layer"
    assert s.admin_port == 8300
    assert s.admin_token is None
    assert s.control_host == "127.0.0.1"
    assert s.control_port == 5600
    assert s.engine_ipc == "ipc:///dev/shm/kvsidecar/engine.sock"
    assert s.transport == "tcp"
    assert s.mooncake_rpc_port is None
    assert s.max_descriptors_per_submit == 1024
    assert s.pool == PoolSettings()
    assert s.pool.enabled is False
    assert s.pool.master_address == "127.0.0.1:50051"
    assert all(
        d > 0 for d in (s.handshake_timeout_s, s.ack_timeout_s, s.send_timeout_s, s.recv_timeout_s)
    )


def test_admin_api_defaults_to_loopback() -> None:
    s = load_settings()
    assert s.admin_host == "127.0.0.1"
    assert SidecarSettings.model_fields["admin_host"].default == "127.0.0.1"
    assert s.warnings() == []


# --- each source on its own -------------------------------------------------------------


def test_env_overrides_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSIDECAR_ROLE", "decode")
    monkeypatch.setenv("KVSIDECAR_ADMIN_PORT", "9000")
    monkeypatch.setenv("KVSIDECAR_TP_SIZE", "4")
    monkeypatch.setenv("KVSIDECAR_RANKS", "2,3")
    monkeypatch.setenv("KVSIDECAR_ADMIN_TOKEN", "s3cret-token")
    monkeypatch.setenv("KVSIDECAR_POOL__ENABLED", "true")
    monkeypatch.setenv("KVSIDECAR_POOL__MASTER_ADDRESS", "mooncake-master:50051")
    monkeypatch.setenv("KVSIDECAR_POOL__GLOBAL_SEGMENT_BYTES", "2GiB")
    s = load_settings()
    assert (s.role, s.admin_port, s.tp_size, s.ranks) == ("decode", 9000, 4, [2, 3])
    assert s.admin_token is not None and s.admin_token.get_secret_value() == "s3cret-token"
    assert "s3cret-token" not in repr(s)
    assert s.pool.enabled and s.pool.master_address == "mooncake-master:50051"
    assert s.pool.global_segment_bytes == 2 << 30


def test_env_accepts_json_lists_and_treats_empty_as_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSIDECAR_TP_SIZE", "2")
    monkeypatch.setenv("KVSIDECAR_RANKS", "[0, 1]")
    # An empty value in a manifest means "not set", not an empty token or port.
    monkeypatch.setenv("KVSIDECAR_ADMIN_TOKEN", "")
    monkeypatch.setenv("KVSIDECAR_MOONCAKE_RPC_PORT", "")
    s = load_settings()
    assert s.ranks == [0, 1]
    assert s.admin_token is None
    assert s.mooncake_rpc_port is None


def test_toml_file_overrides_defaults(tmp_path: Path) -> None:
    path = _write(
        tmp_path / "sidecar.toml",
        """
role = "prefill"
tp_size = 2
ranks = [0, 1]
kv_layout = "HND"
mooncake_rpc_port = 17100
[pool]
enabled = true
local_buffer_bytes = "64MiB"
""",
    )
    s = load_settings(config_path=path)
    assert (s.role, s.tp_size, s.ranks, s.kv_layout) == ("prefill", 2, [0, 1], "HND")
    assert s.mooncake_rpc_port == 17100
    assert s.pool.enabled and s.pool.local_buffer_bytes == 64 << 20
    assert s.pool.master_address == "127.0.0.1:50051"


def test_json_file_and_config_env_var(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _write(tmp_path / "sidecar.json", json.dumps({"admin_port": 8400, "layers": 4}))
    monkeypatch.setenv(CONFIG_ENV_VAR, str(path))
    s = load_settings()
    assert (s.admin_port, s.layers) == (8400, 4)
    # Plain construction honours KVSIDECAR_CONFIG too.
    assert SidecarSettings().admin_port == 8400


def test_explicit_path_beats_config_env_var(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(CONFIG_ENV_VAR, str(_write(tmp_path / "a.toml", "admin_port = 8401\n")))
    explicit = _write(tmp_path / "b.toml", "admin_port = 8402\n")
    assert load_settings(config_path=explicit).admin_port == 8402


def test_cli_overrides_and_unset_flags(tmp_path: Path) -> None:
    s = load_settings({"role": "decode", "admin_port": None, "pool.enabled": True})
    assert s.role == "decode"
    assert s.admin_port == 8300, "a flag left at None must not hide lower layers"
    assert s.pool.enabled


# --- precedence ----------------------------------------------------------------------------


def test_precedence_cli_over_env_over_file_over_defaults(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _write(
        tmp_path / "sidecar.toml",
        'admin_port = 9001\ncontrol_port = 9101\nrole = "prefill"\n'
        '[pool]\nenabled = true\nmaster_address = "file-master:50051"\n',
    )
    monkeypatch.setenv("KVSIDECAR_ADMIN_PORT", "9002")
    monkeypatch.setenv("KVSIDECAR_POOL__MASTER_ADDRESS", "env-master:50051")

    s = load_settings({"admin_port": 9003, "pool.local_buffer_bytes": 2 << 20}, path)
    assert s.admin_port == 9003  # CLI
    assert s.control_port == 9101  # file
    assert s.role == "prefill"  # file
    assert s.stream_queue_depth == 64  # default
    # Nested settings merge key by key across the layers.
    assert s.pool.enabled is True  # file
    assert s.pool.master_address == "env-master:50051"  # env
    assert s.pool.local_buffer_bytes == 2 << 20  # CLI

    assert load_settings({}, path).admin_port == 9002  # env once the flag is gone
    monkeypatch.delenv("KVSIDECAR_ADMIN_PORT")
    assert load_settings({}, path).admin_port == 9001  # then the file
    assert load_settings().admin_port == 8300  # then the default


def test_cli_nested_keys_in_every_spelling() -> None:
    for overrides in (
        {"pool.enabled": True},
        {"pool__enabled": True},
        {"pool": {"enabled": True}},
    ):
        assert load_settings(overrides).pool.enabled is True


# --- errors --------------------------------------------------------------------------------


def test_bad_env_value_names_setting_env_var_and_choices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSIDECAR_ROLE", "producer")
    with pytest.raises(ConfigError) as info:
        load_settings()
    (problem,) = _problems(str(info.value))
    assert "role" in problem and "KVSIDECAR_ROLE" in problem
    assert "'prefill', 'decode' or 'both'" in problem
    assert problem.endswith(".")


def test_descriptor_cap_explains_design_section_6() -> None:
    with pytest.raises(ConfigError) as info:
        load_settings({"max_descriptors_per_submit": 4096})
    message = str(info.value)
    assert "KVSIDECAR_MAX_DESCRIPTORS_PER_SUBMIT" in message
    assert str(MAX_DESCRIPTORS_HARD_LIMIT) in message and "DESIGN §6" in message
    assert load_settings({"max_descriptors_per_submit": 2048}).max_descriptors_per_submit == 2048


def test_one_sentence_per_problem() -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(
            {
                "admin_port": 70000,
                "transport": "ib",
                "pool.master_address": "no-port",
                "admin_host": "http://0.0.0.0:8300",
            }
        )
    problems = _problems(str(info.value))
    assert len(problems) == 4
    for env in ("ADMIN_PORT", "TRANSPORT", "POOL__MASTER_ADDRESS", "ADMIN_HOST"):
        assert sum(f"(KVSIDECAR_{env})" in p for p in problems) == 1, env
    assert all(p.endswith(".") for p in problems)
    assert "4 problems" in str(info.value).splitlines()[0]


def test_cross_field_problems_name_both_settings() -> None:
    with pytest.raises(ConfigError) as info:
        load_settings({"tp_size": 2, "ranks": "0,2", "control_port": 8300})
    problems = _problems(str(info.value))
    assert len(problems) == 2
    assert "KVSIDECAR_RANKS" in problems[0] and "KVSIDECAR_TP_SIZE" in problems[0]
    assert "KVSIDECAR_CONTROL_PORT" in problems[1] and "KVSIDECAR_ADMIN_PORT" in problems[1]


def test_port_collision_with_pinned_mooncake_port() -> None:
    with pytest.raises(ConfigError, match="KVSIDECAR_MOONCAKE_RPC_PORT"):
        load_settings({"mooncake_rpc_port": 5600})


def test_unknown_key_in_file_suggests_the_setting(tmp_path: Path) -> None:
    path = _write(tmp_path / "s.toml", "admin_prot = 1\n")
    with pytest.raises(ConfigError) as info:
        load_settings(config_path=path)
    assert "'admin_prot'" in str(info.value)
    assert "'admin_port' (KVSIDECAR_ADMIN_PORT)" in str(info.value)


def test_unknown_env_var_is_a_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSIDECAR_ADMIN_PROT", "1")
    notes = load_settings().warnings()
    assert any("KVSIDECAR_ADMIN_PROT" in n and "KVSIDECAR_ADMIN_PORT" in n for n in notes)


def test_secret_is_not_echoed_in_errors() -> None:
    with pytest.raises(ConfigError) as info:
        load_settings({"admin_token": 12345})
    assert "12345" not in str(info.value)
    assert "KVSIDECAR_ADMIN_TOKEN" in str(info.value)


def test_nested_env_errors_name_the_nested_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSIDECAR_POOL__LOCAL_BUFFER_BYTES", "lots")
    with pytest.raises(ConfigError, match="KVSIDECAR_POOL__LOCAL_BUFFER_BYTES"):
        load_settings()
    monkeypatch.delenv("KVSIDECAR_POOL__LOCAL_BUFFER_BYTES")
    monkeypatch.setenv("KVSIDECAR_POOL", "{not json")
    with pytest.raises(ConfigError, match="KVSIDECAR_POOL__ENABLED"):
        load_settings()


@pytest.mark.parametrize(
    ("name", "text", "expected"),
    [
        ("s.yaml", "role: decode\n", "use a .toml or .json file"),
        ("s.toml", "role = \n", "not valid TOML"),
        ("s.json", "{", "not valid JSON"),
        ("s.json", "[1, 2]", "table of settings"),
    ],
)
def test_bad_config_files(tmp_path: Path, name: str, text: str, expected: str) -> None:
    with pytest.raises(ConfigError, match=expected):
        load_settings(config_path=_write(tmp_path / name, text))


def test_missing_config_file_names_the_env_var(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(config_path=tmp_path / "absent.toml")
    assert "absent.toml" in str(info.value) and CONFIG_ENV_VAR in str(info.value)


def test_unknown_model_lists_presets() -> None:
    with pytest.raises(ConfigError) as info:
        load_settings({"model": "llama-3.1-8"})
    assert "KVSIDECAR_MODEL" in str(info.value)
    assert "did you mean 'llama-3.1-8b'" in str(info.value)


@pytest.mark.parametrize(
    ("overrides", "env"),
    [
        ({"ranks": []}, "KVSIDECAR_RANKS"),
        ({"ranks": "0,0"}, "KVSIDECAR_RANKS"),
        ({"engine_id": "has space"}, "KVSIDECAR_ENGINE_ID"),
        ({"engine_ipc": "/dev/shm/x.sock"}, "KVSIDECAR_ENGINE_IPC"),
        ({"advertise_host": "0.0.0.0"}, "KVSIDECAR_ADVERTISE_HOST"),
        ({"ack_timeout_s": 0}, "KVSIDECAR_ACK_TIMEOUT_S"),
        ({"recv_timeout_s": 60000}, "KVSIDECAR_RECV_TIMEOUT_S"),
        ({"spin_threads": 0}, "KVSIDECAR_SPIN_THREADS"),
        ({"layers": 0}, "KVSIDECAR_LAYERS"),
        ({"dtype": "int4"}, "KVSIDECAR_DTYPE"),
        ({"pool.global_segment_bytes": -1}, "KVSIDECAR_POOL__GLOBAL_SEGMENT_BYTES"),
    ],
)
def test_each_invalid_value_is_a_config_error(overrides: dict[str, object], env: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(overrides)
    assert env in str(info.value)


# --- derived values, warnings, the table -------------------------------------------------


def test_advertise_host() -> None:
    assert load_settings().resolved_advertise_host() == "127.0.0.1"
    # A control port other hosts can reach needs the control-plane key (app.transfer.wire.auth).
    key = {"auth_key": "k" * 32}
    s = load_settings({"control_host": "0.0.0.0", "advertise_host": "10.0.0.5", **key})
    assert s.resolved_advertise_host() == "10.0.0.5"
    assert load_settings({"control_host": "0.0.0.0", **key}).resolved_advertise_host() != "0.0.0.0"


def test_exposed_admin_without_token_warns() -> None:
    notes = load_settings({"admin_host": "0.0.0.0"}).warnings()
    assert any(env_var_for("admin_token") in n for n in notes)
    assert not load_settings({"admin_host": "0.0.0.0", "admin_token": "t" * 32}).warnings()


def test_dtype_choices_are_known_to_the_kv_specs() -> None:
    from app.kvcache import specs

    choices = get_args(get_args(SidecarSettings.model_fields["dtype"].annotation)[0])
    assert set(choices) <= set(specs.DTYPE_BYTES)


def test_settings_table_covers_every_setting() -> None:
    rows = settings_table()
    names = [row[0] for row in rows]
    expected = [n for n in SidecarSettings.model_fields if n != "pool"]
    expected += [f"pool.{n}" for n in PoolSettings.model_fields]
    assert sorted(names) == sorted(expected)
    for setting, env, default, description in rows:
        assert env == env_var_for(setting)
        assert description, f"{setting} has no description"
        assert default
    table = dict((r[0], r) for r in rows)
    assert table["admin_host"][2] == "127.0.0.1"
    assert table["engine_id"][2] == "host name"
    assert table["pool.master_address"][1] == "KVSIDECAR_POOL__MASTER_ADDRESS"
    assert table["ranks"][2] == "0"
    markdown = render_settings_table().splitlines()
    assert len(markdown) == len(rows) + 2


def test_env_var_for() -> None:
    assert env_var_for("admin_port") == "KVSIDECAR_ADMIN_PORT"
    assert env_var_for("pool.enabled") == "KVSIDECAR_POOL__ENABLED"
