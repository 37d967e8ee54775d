"""FastAPI dependencies of the admin API: the sidecar a route reads, and who may change it.

Routes reach the sidecar through ``app.state`` (one app per sidecar, and tests run several in
one process), never through module globals.
"""

from __future__ import annotations

import secrets
from typing import Annotated, Any

from fastapi import Depends, HTTPException, Request, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from app.api.metrics import SidecarMetrics
from app.api.routes import error_doc
from app.api.schemas import KVTargetBody
from app.config import SidecarSettings, env_var_for
from app.transfer.sidecar.process import Sidecar

bearer = HTTPBearer(auto_error=False, description=f"The value of {env_var_for('admin_token')}.")
Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]


def get_sidecar(request: Request) -> Sidecar:
    sidecar: Sidecar = request.app.state.sidecar
    return sidecar


def get_metrics(request: Request) -> SidecarMetrics:
    metrics: SidecarMetrics = request.app.state.metrics
    return metrics


SidecarDep = Annotated[Sidecar, Depends(get_sidecar)]
MetricsDep = Annotated[SidecarMetrics, Depends(get_metrics)]


def admin_token(settings: SidecarSettings) -> bytes | None:
    """What ``app.state.admin_token`` holds: the token as bytes, or None when calls are open."""
    token = settings.admin_token
    return None if token is None else token.get_secret_value().encode()


async def require_admin_token(request: Request, creds: Credentials) -> None:
    """Mutating calls: 401 unless the bearer token matches (anyone may call when none is set)."""
    token: bytes | None = request.app.state.admin_token
    if token is None:
        return
    if creds is None:
        raise HTTPException(
            status.HTTP_401_UNAUTHORIZED,
            detail="this call needs the admin token: send 'Authorization: Bearer <token>'",
            headers={"WWW-Authenticate": "Bearer"},
        )
    # Constant time: the token must not leak through response timing.
    if not secrets.compare_digest(creds.credentials.encode(), token):
        raise HTTPException(
            status.HTTP_401_UNAUTHORIZED,
            detail="the bearer token does not match this sidecar's admin token",
            headers={"WWW-Authenticate": 'Bearer error="invalid_token"'},
        )


def admin_only(settings: SidecarSettings) -> dict[str, Any]:
    """``include_router`` arguments for a router of mutating calls.

    Empty when no token is set, so that an open sidecar's OpenAPI asks for no credentials."""
    if settings.admin_token is None:
        return {}
    return {
        "dependencies": [Depends(require_admin_token)],
        "responses": {401: error_doc("Missing or wrong bearer token.")},
    }


async def checked_target(request: Request, body: KVTargetBody, creds: Credentials) -> KVTargetBody:
    """The body of ``POST /v1/kv_targets``, once its sender may post it.

    A target needs no token: decode's connector holds none, and the sidecar checks the target's
    signature when it takes it. An error ends the send like an abort, so it needs the token."""
    if body.target is None:
        await require_admin_token(request, creds)
    return body
