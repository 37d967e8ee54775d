"""Requests the agents hold: list, one by id, and abort.

Abort is on ``admin_router``, apart from the reads, so that ``create_app`` can put the admin token
dependency (and its 401 in the OpenAPI) on it alone, and only when a token is set.
"""

from __future__ import annotations

import logging
import time
from typing import Annotated, Literal

from fastapi import APIRouter, Body, HTTPException, Path, Query
from pydantic import BeforeValidator

from app.api import views
from app.api.deps import SidecarDep
from app.api.routes import error_doc
from app.api.schemas import (
    AbortBody,
    AbortResponse,
    RequestList,
    RequestLookup,
    RequestState,
    RequestView,
)
from app.errors import KVSidecarError

log = logging.getLogger(__name__)

router = APIRouter(tags=["requests"])
admin_router = APIRouter(tags=["requests"])

_RequestId = Annotated[str, Path(description="The request id the engine admitted.")]


def _upper(value: object) -> object:
    return value.upper() if isinstance(value, str) else value


def _unknown(rid: str) -> str:
    return f"request {rid} is not known to this sidecar (neither in flight nor recently ended)"


@router.get("/v1/requests", response_model=RequestList)
async def list_requests(
    sidecar: SidecarDep,
    state: Annotated[
        RequestState | None,
        BeforeValidator(_upper),
        Query(description="Only requests in this state (case-insensitive)."),
    ] = None,
    side: Annotated[Literal["send", "recv"] | None, Query()] = None,
    rank: Annotated[int | None, Query(ge=0)] = None,
    ended: Annotated[
        bool,
        Query(
            description="Also the recently ended ones (the last 256 per rank), e.g. for "
            "a benchmark that reads every request's timings once a run is over."
        ),
    ] = False,
) -> RequestList:
    """Requests the agents hold: in flight, or final and not yet reported to the engine
    (``ended=true``: and the recently ended ones)."""
    now = time.monotonic()
    held = views.live_requests(sidecar)
    if ended:  # a request still held is shown as held, not also as its history copy
        seen = {(r.id, r.rank, type(r)) for r in held}
        held += [r for r in views.ended_requests(sidecar) if (r.id, r.rank, type(r)) not in seen]
    out: list[RequestView] = []
    for req in held:
        v = views.request_view(req, now)
        if (
            (state is None or v.state is state)
            and (side is None or v.side == side)
            and (rank is None or v.rank == rank)
        ):
            out.append(v)
    return RequestList(count=len(out), requests=out)


@router.get(
    "/v1/requests/{request_id}",
    response_model=RequestLookup,
    responses={404: error_doc("No rank holds or recently ended this request.")},
)
async def get_request(request_id: _RequestId, sidecar: SidecarDep) -> RequestLookup:
    """One request on every rank and side that holds it, or recently ended it."""
    found = views.find_request(sidecar, request_id)
    if not found:
        raise HTTPException(404, detail=_unknown(request_id))
    now = time.monotonic()
    entries = [views.request_view(r, now, timeline=True) for r in found]
    return RequestLookup(id=request_id, entries=entries)


@admin_router.post(
    "/v1/requests/{request_id}/abort",
    response_model=AbortResponse,
    responses={
        400: error_doc("The body is not valid JSON."),
        404: error_doc("No rank holds or recently ended this request."),
        409: error_doc("The request already ended on every rank."),
    },
)
async def abort_request(
    request_id: _RequestId,
    sidecar: SidecarDep,
    body: Annotated[AbortBody | None, Body()] = None,
) -> AbortResponse:
    """End the request as ABORTED on every rank that holds it; prefill tells decode."""
    reason = (body or AbortBody()).reason
    found = views.find_request(sidecar, request_id)
    if not found:
        raise HTTPException(404, detail=_unknown(request_id))
    live = sorted({r.rank for r in found if not r.state.terminal})
    if not live:
        states = ", ".join(f"{r.state.name} on rank {r.rank}" for r in found)
        raise HTTPException(409, detail=f"request {request_id} already ended: {states}")
    for rank in live:
        # Marks it ABORTED before its first await; the peer's ack is bounded by ack_timeout_s.
        try:
            await sidecar.abort(rank, request_id, reason)
        except KVSidecarError as e:  # aborted here all the same; only telling the peer failed
            log.warning("abort of %s on rank %d: could not tell the peer: %s", request_id, rank, e)
    now = time.monotonic()
    entries = [views.request_view(r, now) for r in views.find_request(sidecar, request_id)]
    return AbortResponse(id=request_id, aborted=live, entries=entries)
