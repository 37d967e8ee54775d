"""The retry and decode-sidecar settings are checked, with errors that say what was expected."""

from __future__ import annotations

import re

import pytest

from app.errors import ConfigError
from app.proxy import ProxyConfig
from app.proxy.config import DecodeSidecar, parse_decode_sidecar

D = "http://d:8000"


def _cfg(**kw: object) -> ProxyConfig:
    return ProxyConfig(("http://p:8000",), (D,), "http://proxy", **kw)  # type: ignore[arg-type]


def test_decode_sidecars_are_parsed() -> None:
    assert parse_decode_sidecar(f"{D}/=http://d:9100/,http://d2:9100") == DecodeSidecar(
        D, ("http://d:9100", "http://d2:9100")
    )
    assert _cfg(decode_sidecars=(parse_decode_sidecar(f"{D}=http://d:9100"),)).decode_sidecars


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("http://d:8000", "expected URL=ADMIN_URL"),
        ("http://d:8000=", "expected URL=ADMIN_URL"),
        ("http://d:8000=d:9100", "is not an http(s):// admin URL"),
    ],
)
def test_a_bad_decode_sidecar_is_refused(spec: str, says: str) -> None:
    with pytest.raises(ConfigError, match=r"--decode-sidecar .*" + re.escape(says)):
        parse_decode_sidecar(spec)


def test_a_decode_sidecar_of_an_unknown_decode_is_refused() -> None:
    with pytest.raises(ConfigError, match="not a --decode URL"):
        _cfg(decode_sidecars=(DecodeSidecar("http://other:1", ("http://x:2",)),))


@pytest.mark.parametrize(
    ("kw", "says"),
    [
        ({"retry_budget_ratio": 1.5}, "retry_budget_ratio must be within"),
        ({"retry_budget_ratio": -0.1}, "retry_budget_ratio must be within"),
        ({"retry_budget_min": -1}, "retry_budget_min must not be negative"),
        ({"retry_budget_window_s": 0}, "retry_budget_window_s must be positive"),
        ({"decode_sidecar_token": " \n"}, "decode sidecar token"),
    ],
)
def test_bad_retry_settings_are_refused(kw: dict[str, object], says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        _cfg(**kw)
