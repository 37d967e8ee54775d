"""The request bodies the proxy sends to decode and prefill (pure functions)."""

from __future__ import annotations

from typing import Any


def decode_body(
    body: dict[str, Any], transfer_id: str, router_url: str, traceparent: str | None = None
) -> dict[str, Any]:
    """The client's request, asking decode to take its prompt's KV from a remote prefill.

    Any ``kv_transfer_params`` the client sent are replaced: clients do not steer transfers.
    ``traceparent`` goes in them too: vLLM passes trace headers on only when its own
    OpenTelemetry is on, but always hands the connector its ``kv_transfer_params``.
    """
    params: dict[str, Any] = {
        "do_remote_prefill": True,
        "transfer_id": transfer_id,
        "router_url": router_url,
    }
    if traceparent is not None:
        params["traceparent"] = traceparent
    return {**body, "kv_transfer_params": params}


def local_body(body: dict[str, Any]) -> dict[str, Any]:
    """The client's request for decode alone (no prefill): a plain request, so decode computes
    the prompt itself. Any ``kv_transfer_params`` the client sent are dropped, as above."""
    return {k: v for k, v in body.items() if k != "kv_transfer_params"}


def prefill_body(
    body: dict[str, Any],
    transfer_id: str,
    *,
    target: dict[str, Any] | None = None,
    router_url: str | None = None,
    target_timeout_s: float | None = None,
    traceparent: str | None = None,
) -> dict[str, Any]:
    """The client's prompt as a one-token, non-streamed prefill that pushes KV to ``target``
    (decode first), or to the target its connector fetches from ``router_url`` (concurrent)."""
    # min_tokens above 1 would make vLLM refuse max_tokens=1; stream_options needs a stream.
    out = {k: v for k, v in body.items() if k not in ("stream_options", "min_tokens")}
    out["stream"] = False
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    params: dict[str, Any] = {"do_remote_decode": True, "transfer_id": transfer_id}
    if target is not None:
        params["remote"] = target
    if router_url is not None:
        params["router_url"] = router_url
        params["target_timeout_s"] = target_timeout_s
    if traceparent is not None:
        params["traceparent"] = traceparent  # as for decode
    out["kv_transfer_params"] = params
    return out


def is_streamed(body: dict[str, Any]) -> bool:
    return bool(body.get("stream", False))
