"""Settings and flags: what ``kv-sidecar proxy`` refuses, and how the policies pick."""

from __future__ import annotations

from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from app.cli import proxy as cli_proxy
from app.cli.proxy import proxy_command
from app.errors import ConfigError
from app.proxy import Policy, ProxyConfig
from app.proxy.balancer import Pool
from app.proxy.config import ADMIN_TOKEN_ENV, POOL_TOKEN_ENV, parse_kv_events


def config(**kw: object) -> ProxyConfig:
    base: dict[str, object] = {
        "prefill": ("http://p:8000",),
        "decode": ("http://d:8000/",),
        "public_url": "http://r:9000/",
    }
    return ProxyConfig(**(base | kw))  # type: ignore[arg-type]


def test_urls_are_normalized() -> None:
    cfg = config(policy="least_outstanding")
    assert cfg.decode == ("http://d:8000",)
    assert cfg.router_url == "http://r:9000/v1/kv_targets"
    assert cfg.policy is Policy.LEAST_OUTSTANDING


@pytest.mark.parametrize(
    ("kw", "says"),
    [
        ({"decode": ()}, "no decode instance"),
        ({"prefill": ("p:8000",)}, "expected an http"),
        ({"decode": ("http://d", "http://d/")}, "same URL twice"),
        ({"policy": "random"}, "expected one of round_robin, least_outstanding"),
        ({"target_timeout_s": 0}, "target_timeout_s must be positive"),
        ({"public_url": "r:9000"}, "--public-url"),
    ],
)
def test_bad_settings_say_what_to_change(kw: dict[str, object], says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        config(**kw)


def test_cli_refuses_an_unknown_policy() -> None:
    app = typer.Typer()
    app.command()(proxy_command)
    out = CliRunner().invoke(
        app, ["--prefill", "http://p", "--decode", "http://d", "--policy", "random"]
    )
    assert out.exit_code == 2
    assert "round_robin" in out.output


def test_policies_rotate_among_equals_and_skip_unhealthy() -> None:
    rr = Pool("decode", ["http://a", "http://b", "http://c"], Policy.ROUND_ROBIN)
    for inst in rr.instances:
        inst.mark(True)
    rr.instances[1].mark(False, "down")
    assert [rr.pick().url for _ in range(4)] == ["http://a", "http://c"] * 2

    lo = Pool("decode", ["http://a", "http://b"], Policy.LEAST_OUTSTANDING)
    for inst in lo.instances:
        inst.mark(True)
    assert [lo.pick().url for _ in range(3)] == ["http://a", "http://b", "http://a"]
    busy = lo.acquire()  # b (the rotation's turn) now has a request in flight
    assert busy.url == "http://b"
    assert [lo.pick().url for _ in range(3)] == ["http://a"] * 3
    busy.release()
    busy.release()  # idempotent
    assert lo.instances[1].outstanding == 0


def test_cli_defaults_are_the_configs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[ProxyConfig] = []
    monkeypatch.setattr(cli_proxy, "create_proxy", lambda cfg: made.append(cfg))
    monkeypatch.setattr(cli_proxy._ProxyServer, "run", lambda self, sockets: None)
    monkeypatch.delenv(ADMIN_TOKEN_ENV, raising=False)
    monkeypatch.delenv(POOL_TOKEN_ENV, raising=False)
    token_file = tmp_path / "admin-token"
    token_file.write_text("operator-only\n")
    app = typer.Typer()
    app.command()(proxy_command)
    args = ["--prefill", "http://p", "--decode", "http://d", "--port", "0"]
    out = CliRunner().invoke(app, [*args, "--admin-token-file", str(token_file)])
    assert out.exit_code == 0, out.output
    (cfg,) = made
    # Every setting the CLI leaves alone is ProxyConfig's own default.
    assert cfg == ProxyConfig(
        ("http://p",), ("http://d",), cfg.public_url, admin_token="operator-only"
    )


def test_kv_events_flags_name_configured_instances_and_zmq_endpoints() -> None:
    got = parse_kv_events("http://p:8000/=tcp://p:5557,tcp://p:5558")
    assert (got.name, got.endpoint, got.replay_endpoint) == (
        "http://p:8000",
        "tcp://p:5557",
        "tcp://p:5558",
    )
    assert parse_kv_events("http://p:8000=ipc:///run/kv").replay_endpoint is None
    for bad, says in [
        ("tcp://p:5557", "expected URL=ENDPOINT"),
        ("http://p:8000=", "expected URL=ENDPOINT"),
        ("http://p:8000=http://p:5557", "not a ZMQ tcp://"),
        ("http://p:8000=tcp://a,tcp://b,tcp://c", "expected URL=ENDPOINT"),
    ]:
        with pytest.raises(ConfigError, match=says):
            parse_kv_events(bad)
    with pytest.raises(ConfigError, match="not a --prefill or --decode URL"):
        config(kv_events=(parse_kv_events("http://other:1=tcp://o:1"),))
    twice = parse_kv_events("http://p:8000=tcp://p:1")
    with pytest.raises(ConfigError, match="names an instance twice"):
        config(kv_events=(twice, twice))
    with pytest.raises(ConfigError, match="kv_events_unit must be at least 1"):
        config(kv_events_unit=0)
    assert config(kv_events=(twice,)).kv_events == (twice,)
