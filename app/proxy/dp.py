"""Data-parallel ranks as instances: ``http://host:port#dp1`` is DP rank 1 of that server.

vLLM's API server spreads requests over its DP engines unless a request names one with the
``X-data-parallel-rank`` header. Each DP rank holds its own KV cache, prefix cache and sidecar
agent, so the proxy routes to (server, rank) pairs: picks, loads, breakers and transfer
records are per rank, and every request to such an instance names its rank.
"""

from __future__ import annotations

import re

from app.errors import ConfigError

DP_RANK_HEADER = "X-data-parallel-rank"
_FRAGMENT = re.compile(r"^(?P<base>[^#]+)(?:#dp(?P<rank>\d+))?$")


def upstream(url: str) -> tuple[str, dict[str, str]]:
    """The server's URL and the headers that pin a request to the instance's DP rank."""
    m = _FRAGMENT.match(url)
    if m is None:
        raise ConfigError(
            f"instance {url!r}: expected a URL, with #dp<rank> after it for one DP rank"
        )
    rank = m.group("rank")
    return m.group("base"), ({} if rank is None else {DP_RANK_HEADER: rank})


def dp_rank(url: str) -> int | None:
    """The DP rank an instance URL names (None: the server picks)."""
    rank = upstream(url)[1].get(DP_RANK_HEADER)
    return None if rank is None else int(rank)
