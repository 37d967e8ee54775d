"""The connector's calls to the router (the proxy's target rendezvous, or prefill's sidecar in
the prefill-first flow): decode posts its signed target, prefill fetches it.

Both go through one ``httpx.Client`` per worker, kept alive: a client built per call made an
SSL context each time, 50 ms of CPU here (measured), and decode's post is on the path of every
disaggregated request's first token (prefill's layers wait for the target).
"""

from __future__ import annotations

import logging

import httpx
import msgspec

from app.connectors.params import TRANSFER_TOKEN_HEADER
from app.connectors.vllm.config import PP_PLACEHOLDER
from app.errors import KVSidecarError
from app.transfer.wire.protocol import RemoteTarget
from app.transfer.wire.target_auth import remote_target

log = logging.getLogger(__name__)


def router_client() -> httpx.Client:
    """The worker's client: enough connections for every held fetch (one per send waiting
    for its target) and the posts."""
    # Idle connections go before the router's keep-alive (5 s, uvicorn's) can close one under
    # a post: that post would fail with a read error.
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=8, keepalive_expiry=2.0)
    return httpx.Client(limits=limits)


def _capability(token: str | None) -> dict[str, str]:
    return {} if token is None else {TRANSFER_TOKEN_HEADER: token}


def _stage_fields(stage: int, pp_size: int) -> dict[str, int]:
    """Which pipeline stage asks (none without PP: the bodies stay as they were)."""
    return {"pp_stage": stage, "pp_size": pp_size} if pp_size > 1 else {}


def post_target(
    client: httpx.Client,
    router_url: str,
    transfer_id: str,
    target: RemoteTarget,
    token: str | None = None,
    timeout_s: float = 5.0,
    stage: int = 0,
    pp_size: int = 1,
) -> None:
    """Hand a signed decode target to the router (which gives it to the prefill), with the
    transfer's capability (``token``) when the router gave one; pipeline stage ``stage``
    posts its own (to prefill's stage of that number where ``{pp}`` names it in the URL)."""
    router_url = router_url.replace(PP_PLACEHOLDER, str(stage))
    try:
        r = client.post(
            router_url,
            # JSON-able builtins; prefill's connector reads them back with ``remote_target``.
            json={
                "transfer_id": transfer_id,
                "target": msgspec.to_builtins(target),
                **_stage_fields(stage, pp_size),
            },
            headers=_capability(token),
            timeout=timeout_s,
        )
        if r.status_code != 200:
            log.error("router refused target %s: %s %s", transfer_id, r.status_code, r.text)
    except httpx.HTTPError as e:
        log.error("router %s unreachable for target %s: %s", router_url, transfer_id, e)


def fetch_target(
    client: httpx.Client,
    router_url: str,
    transfer_id: str,
    timeout_s: float,
    token: str | None = None,
    stage: int = 0,
    pp_size: int = 1,
) -> RemoteTarget | str:
    """Decode's target for a transfer (for pipeline stage ``stage``), from the router
    (concurrent dispatch), or why none came.

    The router holds the request until decode posted it, the transfer closed, or ``timeout_s``.
    """
    try:
        r = client.get(
            f"{router_url}/{transfer_id}",
            params={"timeout_s": timeout_s, **_stage_fields(stage, pp_size)},
            headers=_capability(token),
            timeout=timeout_s + 5.0,
        )
    except httpx.HTTPError as e:
        return f"router {router_url} unreachable: {e}"
    if r.status_code != 200:
        return f"router answered {r.status_code}: {r.text[:300]}"
    try:
        return remote_target(r.json().get("target"))
    except (KVSidecarError, ValueError) as e:
        return f"router sent no usable target: {e}"
