"""Peer sidecars this one knows."""

from __future__ import annotations

from fastapi import APIRouter

from app.api import views
from app.api.deps import SidecarDep
from app.api.schemas import PeersResponse

router = APIRouter(tags=["state"])


@router.get("/v1/peers", response_model=PeersResponse)
async def get_peers(sidecar: SidecarDep) -> PeersResponse:
    """Decode sidecars this one handshook with (prefill side)."""
    return views.peers(sidecar)
