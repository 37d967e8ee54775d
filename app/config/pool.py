"""The ``[pool]`` table of the settings: the shared KV pool on Mooncake Store."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator

from app.config.values import _check_host, _parse_size


class PoolSettings(BaseModel):
    """The shared KV pool on Mooncake Store (DESIGN §9)."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(
        default=False,
        description="Store and load KV blocks in the shared Mooncake Store pool.",
    )
    master_address: str = Field(
        default="127.0.0.1:50051",
        description="host:port of the mooncake_master RPC service (its default port is 50051).",
    )
    metadata_server: str = Field(
        default="P2PHANDSHAKE",
        description=(
            "Metadata service of the store's transfer engine: P2PHANDSHAKE (no extra service) "
            "or the master's HTTP metadata URL, e.g. http://mooncake-master:8080/metadata."
        ),
    )
    global_segment_bytes: int = Field(
        default=1 << 30,
        ge=0,
        description=(
            "Memory this sidecar contributes to the pool (bytes, or 4GiB / 512MB); "
            "0 makes it a client that only reads and writes other members' memory."
        ),
    )
    local_buffer_bytes: int = Field(
        default=256 << 20,
        ge=1 << 20,
        description="Registered staging buffer for pool puts and gets (bytes, at least 1MiB).",
    )

    tails: bool = Field(
        default=False,
        description=(
            "Also store a request's last partial block (its tail) and let a lookup hit it, so "
            "a conversation's next turn computes only its new tokens, not the rest of the "
            "block its history ends in. Only models whose every KV cache group is full "
            "attention or MLA of one block size take tails (a window, a chunk or a Mamba "
            "state is only hit at block boundaries, as in vLLM)."
        ),
    )

    namespace: str = Field(
        default="",
        max_length=128,
        description=(
            "An operator's name for this deployment's pool objects, part of every key: sidecars "
            "with different namespaces never share an object on one master. The keys already "
            "name the checkpoint (model, revision, dtypes, a fingerprint of the weight files); "
            "set a new namespace on a rollout whose weights vLLM cannot see change (weights "
            "served from a hub name not in the local cache), or to keep tenants apart."
        ),
    )

    @field_validator("global_segment_bytes", "local_buffer_bytes", mode="before")
    @classmethod
    def _sizes(cls, value: object) -> object:
        return _parse_size(value)

    @field_validator("master_address")
    @classmethod
    def _check_master_address(cls, value: str) -> str:
        host, sep, port = value.strip().rpartition(":")
        if not sep or not port.isdigit() or not 1 <= int(port) <= 65535:
            raise ValueError("must be host:port, e.g. 127.0.0.1:50051 or mooncake-master:50051")
        _check_host(host)
        return value.strip()
