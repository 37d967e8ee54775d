"""``/v1/kv_digest``: the share of requests whose KV is digested (issue 51), read and changed
without a restart. The change is on ``admin_router``, which ``create_app`` guards with the admin
token when one is set: turning the check off changes what the sidecar guarantees."""

from __future__ import annotations

import logging

from fastapi import APIRouter

from app.api.deps import SidecarDep
from app.api.routes import error_doc
from app.api.schemas import KVDigestBody, KVDigestResponse

log = logging.getLogger(__name__)

router = APIRouter(tags=["digest"])
admin_router = APIRouter(tags=["digest"])


@router.get("/v1/kv_digest", response_model=KVDigestResponse)
async def get_kv_digest(sidecar: SidecarDep) -> KVDigestResponse:
    """The share of requests whose KV this sidecar digests now."""
    return KVDigestResponse(share=sidecar.digest.value, previous=None)


# A share outside [0, 1] is FastAPI's validation error (422, documented by it).
@admin_router.put(
    "/v1/kv_digest",
    response_model=KVDigestResponse,
    responses={400: error_doc("The body is not JSON.")},
)
async def put_kv_digest(body: KVDigestBody, sidecar: SidecarDep) -> KVDigestResponse:
    """Digest this share of requests from now on: a push's share is drawn when its send ends
    (prefill decides), a pool page's when it is stored or loaded. Until the next start."""
    previous = sidecar.digest.value
    sidecar.digest.set(body.share)
    log.warning("kv_digest.share %.4g -> %.4g (admin API)", previous, body.share)
    return KVDigestResponse(share=body.share, previous=previous)
