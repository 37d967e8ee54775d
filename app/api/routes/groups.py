"""KV cache groups: each group's spec and what moved for it."""

from __future__ import annotations

from fastapi import APIRouter

from app.api import views
from app.api.deps import SidecarDep
from app.api.schemas import GroupsResponse

router = APIRouter(tags=["state"])


@router.get("/v1/groups", response_model=GroupsResponse)
async def get_groups(sidecar: SidecarDep) -> GroupsResponse:
    """Per KV cache group: its spec and transfer counters summed over ranks."""
    return views.groups(sidecar)
