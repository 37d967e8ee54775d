"""The request bodies the proxy sends to decode and prefill, and what it reads back of
decode's answer (pure functions)."""

from __future__ import annotations

import json
import secrets
from collections.abc import Sequence
from typing import Any

# The contract's names, defined once beside the connectors (which must not import the proxy):
# a per-transfer secret the proxy puts in both engines' ``kv_transfer_params`` and their
# connectors send back in a header on ``/v1/kv_targets``, so only the two engines of a
# transfer can post or fetch its target; and decode's report, in its final
# ``kv_transfer_params``, of whether the KV came (``"failed"``: it recomputed the prompt).
from app.connectors.params import (
    KV_LOAD_ERROR_PARAM,
    KV_LOAD_ERRORS,
    KV_LOAD_PARAM,
    KV_SEND_ERROR_PARAM,
    KV_SEND_PARAM,
    TRANSFER_TOKEN_HEADER,
    TRANSFER_TOKEN_PARAM,
)

__all__ = [
    "KV_LOAD_PARAM",
    "TRANSFER_TOKEN_HEADER",
    "TRANSFER_TOKEN_PARAM",
    "decode_body",
    "is_streamed",
    "kv_load_error_of",
    "kv_load_of",
    "kv_send_failure",
    "local_body",
    "new_transfer_token",
    "prefill_body",
    "with_prompt_ids",
]

KV_LOADS = ("ok", "failed")
# vLLM's name (renderers/online_renderer.py) for a chat prompt rendered elsewhere.
PROMPT_IDS_PARAM = "prompt_token_ids"


def new_transfer_token() -> str:
    """256 random bits, URL-safe (43 characters)."""
    return secrets.token_urlsafe(32)


def decode_body(
    body: dict[str, Any],
    transfer_id: str,
    router_url: str,
    token: str,
    traceparent: str | None = None,
    prompt_ids: Sequence[int] | None = None,
) -> dict[str, Any]:
    """The client's request, asking decode to take its prompt's KV from a remote prefill.

    Any ``kv_transfer_params`` the client sent are replaced: clients do not steer transfers.
    ``traceparent`` goes in them too: vLLM passes trace headers on only when its own
    OpenTelemetry is on, but always hands the connector its ``kv_transfer_params``.
    ``prompt_ids``: a chat request's rendered ids (``with_prompt_ids``).
    """
    params: dict[str, Any] = {
        "do_remote_prefill": True,
        "transfer_id": transfer_id,
        "router_url": router_url,
        TRANSFER_TOKEN_PARAM: token,
    }
    if traceparent is not None:
        params["traceparent"] = traceparent
    return with_prompt_ids({**body, "kv_transfer_params": params}, prompt_ids)


def local_body(body: dict[str, Any], prompt_ids: Sequence[int] | None = None) -> dict[str, Any]:
    """The client's request for decode alone (no prefill): a plain request, so decode computes
    the prompt itself. Any ``kv_transfer_params`` the client sent are dropped, as above."""
    out = {k: v for k, v in body.items() if k != "kv_transfer_params"}
    return with_prompt_ids(out, prompt_ids)


def with_prompt_ids(out: dict[str, Any], prompt_ids: Sequence[int] | None) -> dict[str, Any]:
    """``out`` with a chat request's rendered ids in its ``kv_transfer_params``, where vLLM
    0.32's chat completions take them instead of rendering the messages (and pop them before
    the connector sees the params): prefill and decode compute on the ids the proxy routed."""
    if prompt_ids is None:
        return out
    params = dict(out.get("kv_transfer_params") or {})
    params[PROMPT_IDS_PARAM] = list(prompt_ids)
    return {**out, "kv_transfer_params": params}


def prefill_body(
    body: dict[str, Any],
    transfer_id: str,
    *,
    token: str,
    targets: list[dict[str, Any]] | None = None,
    router_url: str | None = None,
    target_timeout_s: float | None = None,
    traceparent: str | None = None,
    prompt_ids: Sequence[int] | None = None,
) -> dict[str, Any]:
    """The client's prompt as a one-token, non-streamed prefill that pushes KV to ``targets``
    (decode first: one per decode pipeline stage), or to the target its connector fetches from
    ``router_url`` (concurrent)."""
    # min_tokens above 1 would make vLLM refuse max_tokens=1; stream_options needs a stream.
    out = {k: v for k, v in body.items() if k not in ("stream_options", "min_tokens")}
    out["stream"] = False
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    params: dict[str, Any] = {
        "do_remote_decode": True,
        "transfer_id": transfer_id,
        TRANSFER_TOKEN_PARAM: token,
    }
    if targets:
        params["remote"] = targets[0]
        if len(targets) > 1:  # pipeline parallel: prefill's stage k writes to decode's stage k
            params["remote_stages"] = targets
    if router_url is not None:
        params["router_url"] = router_url
        params["target_timeout_s"] = target_timeout_s
    if traceparent is not None:
        params["traceparent"] = traceparent  # as for decode
    out["kv_transfer_params"] = params
    return with_prompt_ids(out, prompt_ids)


def is_streamed(body: dict[str, Any]) -> bool:
    return bool(body.get("stream", False))


def _transfer_params(content: bytes, name: str) -> dict[str, Any] | None:
    """An answer's ``kv_transfer_params`` when it names ``name``, else None."""
    # Most answers do not carry it: they are not parsed at all.
    if name.encode() not in content:
        return None
    try:
        answer = json.loads(content)
    except (ValueError, RecursionError):  # not JSON (or not UTF-8), or nested past parsing
        return None
    params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
    return params if isinstance(params, dict) else None


def kv_load_of(content: bytes) -> str | None:
    """``kv_transfer_params.kv_load`` of decode's whole (non-streamed) answer: ``"ok"``,
    ``"failed"``, or None when absent or not JSON."""
    value = (_transfer_params(content, KV_LOAD_PARAM) or {}).get(KV_LOAD_PARAM)
    return value if value in KV_LOADS else None


def kv_load_error_of(content: bytes) -> str | None:
    """Why decode recomputed, as its connector said beside ``kv_load: "failed"`` (one of
    ``KV_LOAD_ERRORS``, e.g. ``kv_digest_mismatch``), or None when it said nothing known."""
    params = _transfer_params(content, KV_LOAD_ERROR_PARAM) or {}
    if params.get(KV_LOAD_PARAM) != "failed":
        return None
    value = params.get(KV_LOAD_ERROR_PARAM)
    return value if value in KV_LOAD_ERRORS else None


def kv_send_failure(content: bytes) -> str | None:
    """Why prefill's connector sent nothing (its answer says ``kv_send: "failed"``), else
    None."""
    params = _transfer_params(content, KV_SEND_PARAM) or {}
    if params.get(KV_SEND_PARAM) != "failed":
        return None
    return str(params.get(KV_SEND_ERROR_PARAM) or "prefill's connector sent nothing")[:300]
