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

KV_LOAD_ERROR_PARAM = "kv_load_error"
"""Beside ``kv_load: "failed"``, why, where decode's connector knows it: one of
``KV_LOAD_ERRORS``."""

KV_DIGEST_MISMATCH = "kv_digest_mismatch"
"""The KV landed, but decode's sidecar found its digest differs from prefill's (issue 51)."""

KV_LOAD_FAILED = "transfer_failed"
"""Any other failure decode's sidecar reported for the load (its error is in its log)."""

KV_LOAD_ERRORS = (KV_DIGEST_MISMATCH, KV_LOAD_FAILED)

KV_SEND_PARAM = "kv_send"
"""In prefill's answer's ``kv_transfer_params``: "failed" when its sidecar was gone (exited or
killed) as the request finished, so nothing reached decode; the router tells decode to stop
waiting. Absent otherwise."""

KV_SEND_ERROR_PARAM = "kv_send_error"
"""Beside ``kv_send: "failed"``: why, in a sentence."""
