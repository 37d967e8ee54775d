"""The shared KV pool (Mooncake Store): its counters, and the router's lookup.

The lookup needs the admin token when one is set (``KVSIDECAR_ADMIN_TOKEN``): it changes
nothing, but it tells whether a given token sequence is cached, so anyone who could call it
could probe which prompts others sent. The proxy holds the token (``--pool-lookup-token-file``).
Without a token it is open like every other admin call: the admin API then binds loopback
unless the operator says otherwise (and is warned at start).
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, HTTPException

from app.api import views
from app.api.deps import SidecarDep, require_admin_token
from app.api.routes import error_doc
from app.api.schemas import PoolLookupBody, PoolLookupResponse, PoolResponse
from app.errors import KVSidecarError

router = APIRouter(tags=["pool"])


@router.get("/v1/pool", response_model=PoolResponse)
async def get_pool(sidecar: SidecarDep) -> PoolResponse:
    """The shared KV pool (Mooncake Store): hits, misses, bytes, keys, back-pressure."""
    return views.pool(sidecar)


# A POST only because a prompt's token ids do not fit a query string: it changes nothing, but
# its answer is a side channel on other clients' prompts, so it needs the token (docstring).
@router.post(
    "/v1/pool/lookup",
    response_model=PoolLookupResponse,
    dependencies=[Depends(require_admin_token)],
    responses={
        400: error_doc("The body is not JSON."),
        401: error_doc("Missing or wrong bearer token (when the sidecar has an admin token)."),
        409: error_doc("The KV pool is not enabled on this sidecar."),
        503: error_doc("The pool's store did not answer."),
    },
)
async def pool_lookup(body: PoolLookupBody, sidecar: SidecarDep) -> PoolLookupResponse:
    """How much of a prompt the shared KV pool could serve an engine now (the proxy's
    second tier): one batched existence check, read-only; needs the admin token when set."""
    svc = sidecar.pool
    if svc is None:
        raise HTTPException(
            409, detail="the KV pool is not enabled on this sidecar (KVSIDECAR_POOL__ENABLED)"
        )
    try:
        hit, block = await svc.router_lookup(body.token_ids, body.cache_salt, body.model)
    except KVSidecarError as e:  # the store unreachable or slow: the router goes without
        raise HTTPException(503, detail=f"the KV pool did not answer: {e}") from None
    return PoolLookupResponse(hit_tokens=hit, block_size=block)
