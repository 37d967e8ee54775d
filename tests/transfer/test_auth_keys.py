"""Where the control-plane key comes from: a file (a mounted Secret), a setting, or the per-user
key file that loopback sidecars create once and share; and the settings check that refuses a
reachable control port without a key."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from app.config import env_var_for, load_settings
from app.errors import ConfigError
from app.transfer.wire import auth
from app.transfer.wire.auth import FrameAuth, load_auth, read_key_file, user_key, user_key_path

pytestmark = pytest.mark.timeout(120)

KEY_TEXT = "0123456789abcdef" * 4  # 64 characters


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No developer KVSIDECAR_* variables, and a private runtime dir for the per-user key."""
    for var in list(os.environ):
        if var.upper().startswith("KVSIDECAR_"):
            monkeypatch.delenv(var)
    runtime = tmp_path / "runtime"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))


def mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


# --- key files -----------------------------------------------------------------------------


def test_key_file_is_read_without_surrounding_whitespace(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_text(KEY_TEXT)
    b.write_text(KEY_TEXT + "\n")  # kubectl --from-file of an echo'ed key
    assert read_key_file(a) == read_key_file(b) == KEY_TEXT.encode()


def test_short_missing_or_huge_key_file_says_what_is_wrong(tmp_path: Path) -> None:
    short = tmp_path / "short"
    short.write_text("x" * 31 + "\n")
    with pytest.raises(ConfigError, match="expected at least 32 bytes of key material, got 31"):
        read_key_file(short)
    with pytest.raises(ConfigError, match="cannot be read"):
        read_key_file(tmp_path / "absent")
    huge = tmp_path / "huge"
    huge.write_bytes(b"x" * 10_000)
    with pytest.raises(ConfigError, match="is the path right"):
        read_key_file(huge)


# --- the per-user key ----------------------------------------------------------------------


def test_user_key_path_prefers_the_runtime_dir(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    assert user_key_path() == tmp_path / "runtime" / "kv-sidecar" / "auth.key"
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # ignored: every process must agree
    monkeypatch.setattr(tempfile, "tempdir", None)  # so that gettempdir() would see TMPDIR
    assert user_key_path() == Path(f"/tmp/kv-sidecar-{os.getuid()}/auth.key")


def test_user_key_is_created_private_once_and_then_shared(tmp_path: Path) -> None:
    path = tmp_path / "runtime" / "kv-sidecar" / "auth.key"
    first = user_key()
    assert path.is_file()
    assert mode(path) == 0o600
    assert mode(path.parent) == 0o700
    assert len(first) >= 32
    assert user_key() == first == read_key_file(path)
    assert [p.name for p in path.parent.iterdir()] == ["auth.key"], "a temporary file was left"


def test_threads_creating_at_once_end_with_one_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "race" / "auth.key"
    n = 16
    keys: list[bytes] = []
    errors: list[BaseException] = []
    # The worst case, forced: every thread has found no key and makes its own before any of
    # them creates the file (a key is generated only after the file was found absent).
    made = threading.Barrier(n, timeout=30)
    real_token_hex = auth.secrets.token_hex

    def token_hex(nbytes: int) -> str:
        made.wait()
        return real_token_hex(nbytes)

    monkeypatch.setattr(auth.secrets, "token_hex", token_hex)

    def create() -> None:
        try:
            keys.append(user_key(path))
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=create) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(keys) == n and len(set(keys)) == 1
    assert read_key_file(path) == keys[0]
    assert mode(path) == 0o600
    assert [p.name for p in path.parent.iterdir()] == ["auth.key"]


def test_processes_creating_at_once_end_with_one_key(tmp_path: Path) -> None:
    path = tmp_path / "race" / "auth.key"
    go = tmp_path / "go"
    n = 8
    # As with threads, forced: each process generates its key (so it has found none) and then
    # waits until all have, before any of them creates the file.
    script = (
        "import sys, time, pathlib, secrets\n"
        "from app.transfer.wire import auth\n"
        "path, go, me, n = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), sys.argv[3], "
        "int(sys.argv[4])\n"
        "real = secrets.token_hex\n"
        "def token_hex(nbytes):\n"
        "    (go.parent / f'made-{me}').touch()\n"
        "    deadline = time.monotonic() + 30\n"
        "    while len(list(go.parent.glob('made-*'))) < n and time.monotonic() < deadline:\n"
        "        time.sleep(0.001)\n"
        "    return real(nbytes)\n"
        "auth.secrets.token_hex = token_hex\n"
        "while not go.exists(): time.sleep(0.001)\n"
        "print(auth.user_key(path).decode())\n"
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(path), str(go), str(i), str(n)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(n)
    ]
    time.sleep(1.0)  # let every interpreter reach its wait loop
    go.touch()
    outputs = [p.communicate(timeout=60) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err for _, err in outputs]
    keys = {out.strip() for out, _ in outputs}
    assert len(keys) == 1, keys
    assert read_key_file(path).decode() == keys.pop()
    assert mode(path) == 0o600


def test_open_folder_or_key_file_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "open"
    folder.mkdir()
    folder.chmod(0o755)
    with pytest.raises(ConfigError, match=r"mode 755 lets others in.*KVSIDECAR_AUTH_KEY_FILE"):
        user_key(folder / "auth.key")
    folder.chmod(0o700)
    (folder / "auth.key").write_text(KEY_TEXT)
    (folder / "auth.key").chmod(0o644)
    with pytest.raises(ConfigError, match=r"key file .* mode 644"):
        user_key(folder / "auth.key")


@pytest.mark.skipif(os.getuid() != 0, reason="making a file another user's needs root")
def test_key_of_another_user_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "theirs"
    folder.mkdir(mode=0o700)
    key = folder / "auth.key"
    key.write_text(KEY_TEXT)
    key.chmod(0o600)
    os.chown(key, 4242, -1)
    with pytest.raises(ConfigError, match="owned by uid 4242"):
        user_key(key)
    os.chown(folder, 4242, -1)
    with pytest.raises(ConfigError, match=r"key folder .* owned by uid 4242"):
        user_key(key)


def test_symlinked_key_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "links"
    folder.mkdir(mode=0o700)
    target = tmp_path / "elsewhere"
    target.write_text(KEY_TEXT)
    (folder / "auth.key").symlink_to(target)
    with pytest.raises(ConfigError, match="cannot be opened"):
        user_key(folder / "auth.key")
    (tmp_path / "dirlink").symlink_to(folder)
    with pytest.raises(ConfigError, match="not a directory"):
        user_key(tmp_path / "dirlink" / "auth.key")


# --- settings and load_auth ----------------------------------------------------------------


def test_load_auth_from_a_key_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    key = tmp_path / "secret" / "key"
    key.parent.mkdir()
    key.write_text(KEY_TEXT + "\n")
    monkeypatch.setenv(env_var_for("auth_key_file"), str(key))
    monkeypatch.setenv(env_var_for("control_host"), "0.0.0.0")
    settings = load_settings()
    assert load_auth(settings) == FrameAuth(KEY_TEXT.encode())
    key.write_text("short")
    with pytest.raises(ConfigError, match=r"KVSIDECAR_AUTH_KEY_FILE.*at least 32 bytes"):
        load_auth(settings)


def test_load_auth_from_the_key_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(env_var_for("auth_key"), KEY_TEXT)
    settings = load_settings({"control_host": "10.0.0.5"})
    assert KEY_TEXT not in repr(settings)
    assert load_auth(settings) == FrameAuth(KEY_TEXT.encode())


def test_short_key_setting_is_refused_and_not_echoed() -> None:
    with pytest.raises(ConfigError) as info:
        load_settings({"auth_key": "too-short-but-secret"})
    text = str(info.value)
    assert "KVSIDECAR_AUTH_KEY" in text and "at least 32 characters" in text
    assert "too-short-but-secret" not in text


def test_loopback_without_a_key_uses_the_per_user_key(tmp_path: Path) -> None:
    a = load_auth(load_settings({"control_host": "127.0.0.1"}))
    b = load_auth(load_settings({"control_host": "localhost"}))
    assert a == b == FrameAuth(read_key_file(user_key_path()))


@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3", "::", "decode-0.example"])
def test_reachable_control_port_without_a_key_is_refused(host: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings({"control_host": host})
    text = str(info.value)
    assert "no control-plane key is set" in text
    assert "Mount a Secret" in text and "KVSIDECAR_AUTH_KEY_FILE" in text


def test_both_key_settings_at_once_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="are both set: set one"):
        load_settings({"auth_key_file": str(tmp_path / "k"), "auth_key": KEY_TEXT})
