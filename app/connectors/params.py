"""Names in the contract between a router and the engines' connectors (``kv_transfer_params``
and the target rendezvous calls); the proxy and the connectors both read them from here."""

from __future__ import annotations

TRANSFER_TOKEN_PARAM = "transfer_token"
"""A transfer's capability: the proxy mints one per transfer and hands it to decode and prefill
only, in their ``kv_transfer_params``."""

TRANSFER_TOKEN_HEADER = "x-kv-transfer-token"
"""The header a connector sends its capability in, posting or fetching the transfer's target."""

KV_LOAD_PARAM = "kv_load"
"""In decode's answer's ``kv_transfer_params``: "ok" when prefill's KV was used, "failed" when
decode recomputed the prompt."""
