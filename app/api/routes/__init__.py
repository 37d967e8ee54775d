"""The admin API's routes, one ``APIRouter`` per resource; ``server.create_app`` includes them.

Routes get the sidecar and the admin token check from ``app.api.deps``, never from globals:
one process may run several apps (tests do).
"""

from __future__ import annotations

from typing import Any

from app.api.schemas import ErrorResponse


def error_doc(description: str) -> dict[str, Any]:
    """An OpenAPI ``responses`` entry for an answer in ``ErrorResponse``'s shape."""
    return {"model": ErrorResponse, "description": description}
