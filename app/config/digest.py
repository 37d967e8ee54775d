"""The ``[kv_digest]`` table of the settings: the KV digest of each push (issue 51)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class DigestSettings(BaseModel):
    """Which requests' KV prefill digests and decode checks before the request is DONE."""

    model_config = ConfigDict(extra="forbid")

    share: float = Field(
        default=0.125,
        ge=0.0,
        le=1.0,
        description=(
            "Share of requests whose KV is digested on both sides, every block of each: prefill "
            "picks that share of its pushes (any n of them: n x share, give or take 2, at random "
            "places); the pool, pages by a hash of their key. 0 turns the digest off, 1 checks "
            "everything. "
            "Prefill decides; decode checks whatever digests a Done carries. Host KV is "
            "digested with numpy, device KV (CUDA, NPU) with torch ops on the device. A mismatch "
            "fails the request and decode recomputes it."
        ),
    )
