"""The pool tier against a real sidecar admin app that has an admin token: the proxy sends the
token it was given (``pool_lookup_token``) and its picks get the pool's hits; without it, or
with another, the lookup is refused, the pick goes without the pool, and the record and one
warning say which setting is missing.

The sidecar is never started: its admin app is served over real HTTP, its pool replaced by a
stub that holds the first 1024 tokens of every prompt (the real lookup is tested against a
real Mooncake Store in tests/connectors/vllm/test_pool_e2e.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from app.api.server import create_app
from app.cli import proxy as cli_proxy
from app.errors import ConfigError
from app.proxy import ProxyConfig
from app.proxy.config import POOL_TOKEN_ENV, POOL_TOKEN_FLAG
from app.transfer.sidecar.process import Sidecar
from tests.conftest import one_rank_settings
from tests.proxy.conftest import Cluster, ServerThread, bound_socket

TOKEN = "the-pool-sidecars-admin-token"
PROMPT = list(range(1000, 2088))  # 1088 tokens


class StubPool:
    async def router_lookup(
        self, token_ids: Sequence[int], cache_salt: str | None = None, model: str | None = None
    ) -> tuple[int, int]:
        return min(1024, len(token_ids)), 128


@pytest.fixture
def sidecar_url(tmp_path: Path) -> Iterator[str]:
    """A prefill sidecar's admin API with an admin token, over HTTP."""
    settings = one_rank_settings("prefill", "pool-credential", tmp_path, TOKEN)
    sidecar = Sidecar(settings)
    sidecar.registry.pool = StubPool()  # type: ignore[assignment]
    app = create_app(sidecar, settings)
    server = ServerThread(app, bound_socket()).start()
    yield server.url
    server.stop()
    app.state.metrics.close()
    sidecar.ctx.term()


def pick(c: Cluster) -> dict[str, object]:
    r = c.post(prompt=PROMPT, max_tokens=1)
    assert r.status_code == 200, r.text
    return dict(c.record(r.headers["x-kv-transfer-id"])["prefill_pick"])


def test_the_proxy_sends_the_token_and_gets_the_pools_hits(
    make_cluster: Callable[..., Cluster], sidecar_url: str
) -> None:
    c = make_cluster().start_proxy(
        prefill_policy="cache_aware", pool_lookup=sidecar_url, pool_lookup_token=f" {TOKEN}\n"
    )
    p = pick(c)
    assert (p["pool_hit_tokens"], p["hit_tier"], p["pool_note"]) == (1024, "pool", None)


@pytest.mark.parametrize("token", [None, "not-the-token"], ids=["none", "wrong"])
def test_without_the_token_the_pick_goes_without_the_pool_and_says_why(
    make_cluster: Callable[..., Cluster],
    sidecar_url: str,
    token: str | None,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="app.proxy.pool_tier")
    c = make_cluster().start_proxy(
        prefill_policy="cache_aware", pool_lookup=sidecar_url, pool_lookup_token=token
    )
    for _ in range(2):
        p = pick(c)
        assert p["pool_hit_tokens"] == 0
        note = str(p["pool_note"])
        assert note.startswith("pool lookup answered 401") and POOL_TOKEN_FLAG in note
    warned = [r for r in caplog.records if "goes without the pool tier" in r.getMessage()]
    assert len(warned) == 1  # once, not once per pick


def test_the_cli_reads_the_token_from_a_file_or_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    made: list[ProxyConfig] = []
    monkeypatch.setattr(cli_proxy, "create_proxy", made.append)
    monkeypatch.setattr(cli_proxy._ProxyServer, "run", lambda self, sockets: None)
    app = typer.Typer()
    app.command()(cli_proxy.proxy_command)
    args = ["--prefill", "http://p", "--decode", "http://d", "--port", "0"]
    f = tmp_path / "pool-token"
    f.write_text(f"{TOKEN}\n")
    monkeypatch.delenv(POOL_TOKEN_ENV, raising=False)
    assert CliRunner().invoke(app, [*args, POOL_TOKEN_FLAG, str(f)]).exit_code == 0
    monkeypatch.setenv(POOL_TOKEN_ENV, "from-the-env")
    assert CliRunner().invoke(app, args).exit_code == 0
    both = CliRunner().invoke(app, [*args, POOL_TOKEN_FLAG, str(f)])
    assert both.exit_code != 0 and "both set" in str(both.exception)
    assert [c.pool_lookup_token for c in made] == [TOKEN, "from-the-env"]
    assert TOKEN not in repr(made[0])
    with pytest.raises(ConfigError, match=r"pool lookup token .* is blank"):
        ProxyConfig(("http://p",), ("http://d",), "http://x", pool_lookup_token=" ")
