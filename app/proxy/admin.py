"""Who may read the transfer records (``GET /v1/transfers``): they name instances, prompts'
sizes and timings, which are the operator's, not every client's.

With an admin token set, a request needs ``Authorization: Bearer <token>`` (401 otherwise);
without one, only loopback clients are answered (403 for others).
"""

from __future__ import annotations

import hmac
import ipaddress

from fastapi import Request
from fastapi.responses import Response

from app.proxy.config import ADMIN_TOKEN_ENV, ADMIN_TOKEN_FLAG
from app.proxy.errors import error_response


def is_loopback(host: str | None) -> bool:
    """Whether a client address is this machine's (an IPv4-mapped IPv6 one too)."""
    if host is None:
        return False
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


def _bearer(request: Request) -> str | None:
    scheme, _, credentials = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not credentials.strip():
        return None
    return credentials.strip()


def admin_refusal(request: Request, token: str | None) -> Response | None:
    """The 401 or 403 to answer instead of the records, or None when the caller may read them."""
    if token is None:
        if is_loopback(request.client.host if request.client else None):
            return None
        return error_response(
            403,
            "transfer records answer loopback clients only while the proxy has no admin token: "
            f"start it with {ADMIN_TOKEN_FLAG} or {ADMIN_TOKEN_ENV} and send "
            "'Authorization: Bearer <token>'",
            "permission_error",
        )
    given = _bearer(request)
    if given is None:
        answer = error_response(
            401,
            "transfer records need the proxy's admin token: send 'Authorization: Bearer <token>'",
            "authentication_error",
        )
        answer.headers["WWW-Authenticate"] = "Bearer"
        return answer
    # Constant time: how much of the token matched must not show in the answer's timing.
    if not hmac.compare_digest(given.encode(), token.encode()):
        answer = error_response(
            401, "the bearer token does not match the proxy's admin token", "authentication_error"
        )
        answer.headers["WWW-Authenticate"] = 'Bearer error="invalid_token"'
        return answer
    return None
