"""The proxy's errors and the OpenAI-shaped JSON error bodies it answers with."""

from __future__ import annotations

from fastapi.responses import JSONResponse

from app.errors import KVSidecarError


class ProxyError(KVSidecarError):
    """Root of the proxy's own errors."""


class NoHealthyInstance(ProxyError):
    """Every instance of one role is marked unhealthy (answered as 503)."""


class TargetError(ProxyError):
    """Decode's connector reported it cannot take a transfer (it posted an error)."""


def error_response(status: int, message: str, kind: str) -> JSONResponse:
    """``{"error": {message, type, code}}``, the shape vLLM and OpenAI clients expect."""
    return JSONResponse(
        {"error": {"message": message, "type": kind, "code": status}}, status_code=status
    )
