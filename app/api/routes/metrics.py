"""``/metrics``: the Prometheus scrape of this app's own registry."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from app.api.deps import MetricsDep

router = APIRouter(tags=["health"])


@router.get(
    "/metrics",
    response_class=PlainTextResponse,
    responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}},
)
async def metrics_text(metrics: MetricsDep) -> PlainTextResponse:
    """Prometheus text exposition (names prefixed ``kvsidecar_``, base units)."""
    return PlainTextResponse(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)
