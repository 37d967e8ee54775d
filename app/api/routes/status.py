"""The sidecar's identity and its ranks' registered KV memory."""

from __future__ import annotations

from fastapi import APIRouter

from app.api import views
from app.api.deps import SidecarDep
from app.api.schemas import RegionsResponse, RegistrationResponse, StatusResponse

router = APIRouter(tags=["state"])


@router.get("/v1/status", response_model=StatusResponse)
async def get_status(sidecar: SidecarDep) -> StatusResponse:
    """Identity, readiness, ranks, Mooncake session and counters, versions."""
    return views.status(sidecar)


@router.get("/v1/regions", response_model=RegionsResponse)
async def get_regions(sidecar: SidecarDep) -> RegionsResponse:
    """The registered KV memory of each rank, as peers see it."""
    return views.regions(sidecar)


@router.get("/v1/registration", response_model=RegistrationResponse)
async def get_registration(sidecar: SidecarDep) -> RegistrationResponse:
    """What each rank's engine registered (ranks registered from presets are absent)."""
    return views.registrations(sidecar)
