"""Transfer records are the operator's: with an admin token they need it (401 without), and
without one only loopback clients are answered (403 for others)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from app.cli.proxy import read_admin_token
from app.errors import ConfigError
from app.proxy import ProxyConfig, create_proxy
from app.proxy.admin import is_loopback
from app.proxy.config import ADMIN_TOKEN_ENV
from tests.proxy.conftest import Cluster

TOKEN = "s3cret-admin-token"
ROUTES = ("/v1/transfers", "/v1/transfers/nope")


def test_with_a_token_set_the_records_need_it(make_cluster: Callable[..., Cluster]) -> None:
    c = make_cluster().start_proxy(admin_token=TOKEN)
    tid = c.post(prompt="x").headers["x-kv-transfer-id"]
    for path in (*ROUTES, f"/v1/transfers/{tid}"):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
            r = c.get(path, headers=headers)
            assert r.status_code == 401, (path, headers, r.text)
            assert r.headers["www-authenticate"].startswith("Bearer")
            assert "admin token" in r.json()["error"]["message"]
            assert TOKEN not in r.text
    good = {"Authorization": f"Bearer {TOKEN}"}
    assert c.get("/v1/transfers", headers=good).json()["transfers"][0]["transfer_id"] == tid
    assert c.get(f"/v1/transfers/{tid}", headers=good).json()["transfer_id"] == tid
    assert c.get("/v1/transfers/nope", headers=good).status_code == 404
    # Completions do not need it (a client's Authorization is the engines' business).
    assert c.post(prompt="y").status_code == 200


def _asgi_client(client_host: str, **cfg: object) -> httpx.AsyncClient:
    config = ProxyConfig(("http://p",), ("http://d",), "http://proxy", **cfg)  # type: ignore[arg-type]
    transport = httpx.ASGITransport(create_proxy(config), client=(client_host, 1234))
    return httpx.AsyncClient(transport=transport, base_url="http://proxy")


async def test_without_a_token_only_loopback_clients_read_the_records() -> None:
    async with _asgi_client("10.1.2.3") as stranger:
        for path in ROUTES:
            r = await stranger.get(path)
            assert r.status_code == 403, (path, r.text)
            assert ADMIN_TOKEN_ENV in r.json()["error"]["message"]
        # Other routes are not the records': they answer whoever asks.
        assert (await stranger.get("/metrics")).status_code == 200
    for host in ("127.0.0.1", "::1", "::ffff:127.0.0.1"):
        async with _asgi_client(host) as local:
            assert (await local.get("/v1/transfers")).json() == {"transfers": []}, host
            assert (await local.get("/v1/transfers/nope")).status_code == 404, host


async def test_with_a_token_the_address_does_not_matter() -> None:
    async with _asgi_client("10.1.2.3", admin_token=TOKEN) as remote:
        good = {"Authorization": f"Bearer {TOKEN}"}
        assert (await remote.get("/v1/transfers", headers=good)).status_code == 200
    async with _asgi_client("127.0.0.1", admin_token=TOKEN) as local:
        assert (await local.get("/v1/transfers")).status_code == 401


def test_loopback_addresses() -> None:
    assert is_loopback("127.0.0.1") and is_loopback("127.8.9.1") and is_loopback("::1")
    assert is_loopback("::ffff:127.0.0.1")
    for host in ("10.1.2.3", "::ffff:10.1.2.3", "fe80::1", "localhost", "", None):
        assert not is_loopback(host), host


def test_admin_token_comes_from_a_file_or_the_environment(tmp_path: Path) -> None:
    f = tmp_path / "token"
    f.write_text(f"{TOKEN}\n")
    assert read_admin_token(f, {}) == TOKEN
    assert read_admin_token(None, {ADMIN_TOKEN_ENV: TOKEN}) == TOKEN
    assert read_admin_token(None, {}) is None
    with pytest.raises(ConfigError, match="both set"):
        read_admin_token(f, {ADMIN_TOKEN_ENV: TOKEN})
    with pytest.raises(ConfigError, match="cannot read it"):
        read_admin_token(tmp_path / "missing", {})
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ConfigError, match="is empty"):
        read_admin_token(tmp_path / "empty", {})
    with pytest.raises(ConfigError, match=r"admin token .* is blank"):
        ProxyConfig(("http://p",), ("http://d",), "http://proxy", admin_token="  ")
    cfg = ProxyConfig(("http://p",), ("http://d",), "http://proxy", admin_token=f"{TOKEN}\n")
    assert cfg.admin_token == TOKEN and TOKEN not in repr(cfg)
