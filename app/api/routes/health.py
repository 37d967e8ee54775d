"""Probes: ``/livez`` and ``/readyz``, never limited by the API's in-flight guard."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from app.api import views
from app.api.deps import SidecarDep
from app.api.schemas import Liveness, Readiness

router = APIRouter(tags=["health"])


@router.get("/livez", response_model=Liveness)
async def livez() -> Liveness:
    """The process and its event loop answer."""
    return Liveness()


@router.get(
    "/readyz",
    response_model=Readiness,
    responses={503: {"model": Readiness, "description": "Not ready; the reason says why."}},
)
async def readyz(sidecar: SidecarDep) -> JSONResponse:
    """Ready once every configured rank registered its KV caches and the ports are bound."""
    ok, reason = views.readiness(sidecar)
    body = Readiness(ready=ok, reason=reason).model_dump()
    return JSONResponse(body, status_code=200 if ok else 503)
