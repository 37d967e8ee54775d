"""``POST /v1/kv_targets``: decode's connector tells prefill's sidecar where a send goes.

Who may post is decided by ``deps.checked_target``: a target by its signature, an error by the
admin token.
"""

from __future__ import annotations

import logging
from typing import Annotated

from fastapi import APIRouter, Depends, HTTPException

from app.api import views
from app.api.deps import SidecarDep, checked_target
from app.api.routes import error_doc
from app.api.schemas import KVTargetBody, KVTargetResponse
from app.errors import AuthError, KVSidecarError
from app.transfer.sidecar.process import Sidecar
from app.transfer.wire.target_auth import remote_target

log = logging.getLogger(__name__)

router = APIRouter(tags=["requests"])


@router.post(
    "/v1/kv_targets",
    response_model=KVTargetResponse,
    responses={
        400: error_doc("Neither a usable target nor an error."),
        401: error_doc(
            "A target not signed by decode's sidecar, or signed for another transfer; or an "
            "error without the token."
        ),
        404: error_doc("No rank holds a send by that id."),
        409: error_doc("The send already ended or already has a target."),
    },
)
async def post_kv_target(
    body: Annotated[KVTargetBody, Depends(checked_target)], sidecar: SidecarDep
) -> KVTargetResponse:
    """Prefill first: decode's connector says where a send this sidecar holds goes (the
    ``router_url`` prefill's answer named), or why it cannot take it (the send ends
    ABORTED at once and prefill's blocks go back).

    A target is authenticated by decode's sidecar's signature (the engines hold no admin
    token) and taken only by the send of the transfer it was signed for; an error ends a
    transfer like an abort and needs the admin token when set."""
    tid = body.transfer_id
    # Which sends are held is no secret (GET /v1/requests lists them); what a target may do
    # is decided by its signature, below.
    holders = [r.rank for r in views.find_request(sidecar, tid) if views.side_of(r) == "send"]
    if not holders:
        raise HTTPException(
            404,
            detail=f"no send {tid!r} on this sidecar: this is not prefill's sidecar for it, "
            "or the prompt was not sent with do_remote_decode",
        )
    if body.target is None:
        if body.error is None:
            raise HTTPException(400, detail="expected a target (an object) or an error")
        ended = [r for r in holders if await _abort_quietly(sidecar, r, tid, body.error)]
        if not ended:
            raise HTTPException(409, detail=f"send {tid!r} already ended")
        return KVTargetResponse(transfer_id=tid, ranks=ended)
    try:
        outcome = sidecar.set_target(tid, remote_target(body.target))
    except AuthError as e:
        raise HTTPException(401, detail=str(e)) from None
    except KVSidecarError as e:
        raise HTTPException(400, detail=str(e)) from None
    refused = {rank: why for rank, why in outcome.items() if why is not None}
    taken = sorted(set(outcome) - set(refused))
    if refused or not taken:
        # Not held any more: it ended and was reported, so no target can be taken.
        why = "; ".join(f"rank {r}: {w}" for r, w in sorted(refused.items()))
        raise HTTPException(409, detail=why or f"send {tid!r} already ended")
    return KVTargetResponse(transfer_id=tid, ranks=taken)


async def _abort_quietly(sidecar: Sidecar, rank: int, tid: str, error: str) -> bool:
    try:
        return await sidecar.abort(rank, tid, f"decode gave no target: {error}")
    except KVSidecarError as e:  # aborted here all the same; only telling the peer failed
        log.warning("abort of %s on rank %d: could not tell the peer: %s", tid, rank, e)
        return True
