"""DP ranks as instances: ``URL#dp<rank>`` routes to one DP rank of a vLLM server.

The proxy keeps each rank apart (its own load, breaker, index), sends the rank in vLLM's
``X-data-parallel-rank`` header, and its records name the ranks that served. The real engines
(vLLM's DP balancer honouring the header) are in tests/connectors/vllm/test_data_parallel.py.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from app.errors import ConfigError
from app.proxy import ProxyConfig
from app.proxy.dp import DP_RANK_HEADER, upstream
from tests.proxy.conftest import Cluster


def ranks(url: str) -> tuple[str, ...]:
    return (f"{url}#dp0", f"{url}#dp1")


def test_each_rank_gets_its_requests_and_the_records_name_it(
    make_cluster: Callable[..., Cluster],
) -> None:
    c = make_cluster()
    (p,), (d,) = c.prefill, c.decode
    c.start_proxy(prefill=ranks(p.url), decode=ranks(d.url), policy="round_robin")
    for _ in range(4):
        assert c.post(prompt="x").status_code == 200
    header = DP_RANK_HEADER.lower()
    assert [s.headers.get(header) for s in d.requests] == ["0", "1", "0", "1"]
    assert [s.headers.get(header) for s in p.requests] == ["0", "1", "0", "1"]
    for seen in d.requests:
        record = c.record(seen.body["kv_transfer_params"]["transfer_id"])
        assert record["decode"] == f"{d.url}#dp{seen.headers[header]}"
        assert record["decode_dp_rank"] == int(seen.headers[header])
        assert record["prefill_dp_rank"] in (0, 1)
    # Both ranks are probed through their server's one /health.
    health = c.get("/health").json()
    assert [i["url"] for i in health["decode"]] == list(ranks(d.url))
    assert all(i["healthy"] for role in ("prefill", "decode") for i in health[role])


def test_a_plain_url_names_no_rank() -> None:
    assert upstream("http://d:8000") == ("http://d:8000", {})
    assert upstream("http://d:8000#dp3") == ("http://d:8000", {DP_RANK_HEADER: "3"})


@pytest.mark.parametrize("url", ["http://d:8000#rank1", "http://d:8000#dp", "http://d:8000#dp1#x"])
def test_a_fragment_that_is_not_a_dp_rank_is_refused(url: str) -> None:
    with pytest.raises(ConfigError, match="#dp<rank>"):
        ProxyConfig(prefill=("http://p:8000",), decode=(url,), public_url="http://r:9000")
