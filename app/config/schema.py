"""The settings schema: ``SidecarSettings``, with its checks (the ``[pool]`` table: ``pool``)."""

from __future__ import annotations

import difflib
import json
import socket
from pathlib import Path
from typing import Annotated, Literal

from pydantic import (
    Field,
    SecretStr,
    field_validator,
    model_validator,
)
from pydantic_settings import (
    BaseSettings,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from app.config.digest import DigestSettings
from app.config.pool import PoolSettings
from app.config.sources import _ConfigFileSource
from app.config.values import (
    _ENGINE_ID_RE,
    _MAX_DEADLINE_S,
    _PRESET_RE,
    DEFAULT_DESCRIPTORS_PER_SUBMIT,
    ENV_NESTED_DELIMITER,
    ENV_PREFIX,
    MAX_DESCRIPTORS_HARD_LIMIT,
    _check_host,
    _default_engine_id,
    _is_loopback,
    _is_wildcard,
    available_presets,
    env_var_for,
    unknown_env_vars,
)


class SidecarSettings(BaseSettings):
    """Everything `kv-sidecar serve` needs, validated before anything binds or registers."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_nested_delimiter=ENV_NESTED_DELIMITER,
        # An empty variable (KVSIDECAR_ADMIN_TOKEN= in a manifest) means "not set", not "".
        env_ignore_empty=True,
        extra="forbid",
        case_sensitive=False,
    )

    # --- identity -------------------------------------------------------------------------------
    role: Literal["prefill", "decode", "both"] = Field(
        default="both",
        description="Which side this sidecar serves: prefill sends KV, decode receives it, both.",
    )
    engine_id: str = Field(
        default_factory=_default_engine_id,
        description="Name of this instance in handshakes, Done messages and the admin API.",
    )
    ranks: Annotated[list[int], NoDecode] = Field(
        default_factory=lambda: [0],
        description="TP ranks whose engines this sidecar serves (one agent each), e.g. 0,1.",
    )
    tp_size: int = Field(
        default=1, ge=1, le=1024, description="Tensor-parallel size of this inference instance."
    )

    # --- model and KV layout -------------------------------------------------------------------
    model: str = Field(
        default="llama-3.1-8b",
        description="Model preset name (a file in app/kvcache/presets, e.g. qwen3-next-80b-a3b).",
    )
    layers: int | None = Field(
        default=None,
        ge=1,
        description="Use only the first N layers of the preset (scaled-down demos and tests).",
    )
    # The names of app.kvcache.specs.DTYPE_BYTES; fp8 variants travel as raw bytes.
    dtype: Literal["bfloat16", "float16", "float32", "fp8", "fp8_e4m3"] | None = Field(
        default=None,
        description="KV cache element type; unset: the preset's dtype (bfloat16 for all shipped).",
    )
    cache_dtype: Literal["auto", "fp8_ds_mla", "nvfp4_ds_mla"] = Field(
        default="auto",
        description="vLLM's packed MLA cache formats (--kv-cache-dtype); auto: plain dtype.",
    )
    conv_layout: Literal["SD", "DS"] = Field(
        default="SD",
        description=(
            "Mamba-style conv state layout: SD state-first (a descriptor per conv row), "
            "DS dim-first (a descriptor per sub-projection slice)."
        ),
    )
    block_size: int = Field(
        default=16,
        ge=1,
        le=65536,
        description="Tokens per scheduler (manager) block, as the engine's --block-size.",
    )
    layout_mode: Literal["per_layer", "cross_layer"] = Field(
        default="per_layer",
        description="per_layer: a tensor per layer; cross_layer: all layers of a block adjacent.",
    )
    kv_layout: Literal["HND", "NHD"] = Field(
        default="NHD",
        description="Element order in a block; HND keeps TP head slices contiguous (fewer writes).",
    )
    device_type: Literal["auto", "cpu", "cuda", "npu"] = Field(
        default="auto",
        description="Where the engine's KV lives; auto picks npu, then cuda, then cpu.",
    )

    # --- admin API ------------------------------------------------------------------------------
    admin_host: str = Field(
        default="127.0.0.1",
        description="Admin API bind address; loopback unless told otherwise (0.0.0.0 in a pod).",
    )
    admin_port: int = Field(
        default=8300, ge=0, le=65535, description="Admin API port; 0: any free one (see port_file)."
    )
    admin_token: SecretStr | None = Field(
        default=None,
        description="Bearer token that mutating admin calls (abort) must present.",
    )

    # --- control plane --------------------------------------------------------------------------
    admin_max_body_bytes: int = Field(
        default=1 << 20,
        ge=1 << 10,
        le=64 << 20,
        description="Largest request body the admin API reads (a decode target of a long "
        "prompt is tens of KiB); larger ones get 413.",
    )
    control_host: str = Field(
        default="127.0.0.1",
        description="Bind address of the ZMQ ROUTER socket peers handshake with.",
    )
    control_port: int = Field(
        default=5600,
        ge=0,
        le=65535,
        description="Peer control port; 0: any free one (see port_file).",
    )
    port_file: Path | None = Field(
        default=None,
        description=(
            'Once both listen, write {"admin_port": N, "control_port": N} here as JSON (a '
            "temporary file renamed over it; removed at start and at a clean stop): how a "
            "launcher learns the ports the OS picked for port 0."
        ),
    )
    advertise_host: str | None = Field(
        default=None,
        description=(
            "Address peers use to reach this sidecar (control port and Mooncake session); "
            "default: control_host, or this host's address when that is a wildcard."
        ),
    )
    auth_key_file: Path | None = Field(
        default=None,
        description=(
            "File holding the control-plane key (at least 32 bytes, e.g. a mounted Secret); "
            "every sidecar must have the same key. With neither this nor auth_key, a loopback "
            "control_host uses a generated per-user key file and any other refuses to start."
        ),
    )
    auth_key: SecretStr | None = Field(
        default=None,
        description=(
            "The control-plane key itself (at least 32 characters), when no auth_key_file; "
            "a file keeps it out of the process environment."
        ),
    )
    engine_ipc: str = Field(
        default="ipc:///dev/shm/kvsidecar/engine.sock",
        description="ZMQ endpoint the engines connect to (ipc:// path shared through /dev/shm).",
    )

    # --- Mooncake transfer engine ---------------------------------------------------------------
    transport: Literal["tcp", "rdma"] = Field(
        default="tcp",
        description="Mooncake protocol; tcp also forces TCP where an HCA exists (MC_FORCE_TCP=1).",
    )
    device_name: str = Field(
        default="",
        description="RDMA device(s) for Mooncake, e.g. mlx5_0 or mlx5_0,mlx5_1; empty: discover.",
    )
    mooncake_rpc_port: int | None = Field(
        default=None,
        ge=1,
        le=65535,
        description="Pin the Mooncake handshake (RPC) port; unset: the engine picks a free one.",
    )
    max_descriptors_per_submit: int = Field(
        default=DEFAULT_DESCRIPTORS_PER_SUBMIT,
        description=(
            f"Cap on descriptors in one Mooncake batch (at most {MAX_DESCRIPTORS_HARD_LIMIT}: "
            "larger batches were rejected and poisoned the peer session, DESIGN §6)."
        ),
    )
    spin_threads: int = Field(
        default=1,
        ge=1,
        le=64,
        description="Threads that run asynchronous Mooncake writes (spin mode: a core each).",
    )
    write_wait: Literal["poll", "spin"] = Field(
        default="poll",
        description=(
            "How a write waits for Mooncake: poll (one transfer per descriptor, polled with short "
            "sleeps; frees the core) or spin (batch sync calls, which busy-spin a core)."
        ),
    )
    stream_queue_depth: int = Field(
        default=64,
        ge=1,
        le=65536,
        description="Bound of each device's layer-task queue; a full queue back-pressures.",
    )

    # --- deadlines (seconds) -------------------------------------------------------------------
    handshake_timeout_s: float = Field(
        default=5.0, gt=0, le=_MAX_DEADLINE_S, description="Deadline of one peer handshake."
    )
    ack_timeout_s: float = Field(
        default=5.0, gt=0, le=_MAX_DEADLINE_S, description="Deadline for a peer to Ack a Done."
    )
    send_timeout_s: float = Field(
        default=30.0,
        gt=0,
        le=_MAX_DEADLINE_S,
        description="Prefill: a send with a target ends EXPIRED after this long without "
        "progress: no chunk of it scheduled, no layer of it signalled or written. A prefill that "
        "still computes and writes chunk after chunk never expires, however long its prompt (up "
        "to transfer_max_s). Also bounds each wait of a send: a layer's event, a full stream "
        "queue, the drain of its writes, and decode's target when the engine named no "
        "target_timeout_s.",
    )
    transfer_max_s: float = Field(
        default=_MAX_DEADLINE_S,
        gt=0,
        le=_MAX_DEADLINE_S,
        description="Both sides: the absolute cap of one transfer however it progresses. A send "
        "ends EXPIRED this long after its admission, a receive this long after prefill's claim.",
    )
    max_target_timeout_s: float = Field(
        default=120.0,
        gt=0,
        le=_MAX_DEADLINE_S,
        description="Prefill: longest a send waits for decode's target, whatever a request's "
        "target_timeout_s asks (longer asks are clamped to this).",
    )
    max_held_sends: int = Field(
        default=256,
        ge=1,
        le=1 << 20,
        description="Prefill: sends a rank holds waiting for decode's target; one more is refused "
        "at once (decode recomputes it).",
    )
    max_held_blocks: int | None = Field(
        default=None,
        ge=1,
        description="Prefill: engine blocks those held sends may pin on a rank, all groups "
        "counted; unset: no bound but the engine's cache.",
    )
    recv_timeout_s: float = Field(
        default=60.0,
        gt=0,
        le=_MAX_DEADLINE_S,
        description="Decode: once a prefill claimed a receive (it claims when its engine "
        "schedules the request), the receive ends EXPIRED after this long without a sign that "
        "prefill still sends it: a claim, a sender's Done, or a prefill heartbeat naming it "
        "(each heartbeat names the sends prefill still has in flight, every "
        "heartbeat_interval_s; keep this several heartbeats long). Also the per-request bound "
        "the connector's recv_timeout_s sets.",
    )
    recv_queue_timeout_s: float | None = Field(
        default=None,
        gt=0,
        le=_MAX_DEADLINE_S,
        description="Decode: how long a receive waits for a prefill to claim it; under load the "
        "request may wait in prefill's queue that long. Unset: recv_timeout_s.",
    )
    heartbeat_interval_s: float = Field(
        default=1.0,
        gt=0,
        le=60,
        description="Interval of the heartbeats a sidecar sends each peer it shares requests with.",
    )
    lease_s: float = Field(
        default=5.0,
        gt=0,
        le=_MAX_DEADLINE_S,
        description="A peer silent this long is dead: its requests end and nothing is written.",
    )
    control_max_frame_bytes: int = Field(
        default=1 << 20,
        ge=64 << 10,
        le=1 << 30,
        description="Largest frame accepted on the control port (and from a peer); larger ones "
        "are refused with an error. Raise it only if AgentMetadata of very many ranks exceeds it.",
    )
    engine_max_frame_bytes: int = Field(
        default=64 << 20,
        ge=64 << 10,
        le=1 << 30,
        description="Largest frame accepted from the local engines (token id lists of whole "
        "prompts: a 1M-token PoolSave is about 5 MiB).",
    )
    quarantine_max_s: float = Field(
        default=30.0,
        gt=0,
        le=_MAX_DEADLINE_S,
        description="Decode: longest a failed request's blocks stay allocated while a prefill "
        "that claimed it may still write (it is silent, not known to be gone).",
    )
    shutdown_grace_s: float = Field(
        default=10.0,
        ge=0,
        le=_MAX_DEADLINE_S,
        description="On SIGTERM, time given to in-flight transfers before they are aborted.",
    )

    # --- KV pool ------------------------------------------------------------------------------
    pool: PoolSettings = Field(
        default_factory=PoolSettings, description="Shared KV pool (Mooncake Store)."
    )

    kv_digest: DigestSettings = Field(default_factory=DigestSettings, description="KV digest.")

    log_level: Literal["debug", "info", "warning", "error"] = Field(
        default="info", description="Log level of the sidecar's loggers."
    )

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """CLI flags (init kwargs) > env > config file > defaults; no dotenv, no secrets dir."""
        return (init_settings, env_settings, _ConfigFileSource(settings_cls))

    # --- field checks -----------------------------------------------------------------------
    @field_validator("ranks", mode="before")
    @classmethod
    def _split_ranks(cls, value: object) -> object:
        # NoDecode: env gives a raw string, so accept both "0,1" and JSON "[0, 1]".
        if isinstance(value, int) and not isinstance(value, bool):
            return [value]
        if isinstance(value, str):
            text = value.strip()
            if text.startswith("["):
                try:
                    return json.loads(text)
                except json.JSONDecodeError:
                    raise ValueError("must be a list of ranks such as 0,1 or [0, 1]") from None
            return [part.strip() for part in text.split(",") if part.strip()]
        return value

    @field_validator("ranks")
    @classmethod
    def _check_ranks(cls, value: list[int]) -> list[int]:
        if not value:
            raise ValueError("must name at least one rank")
        if any(rank < 0 for rank in value):
            raise ValueError("ranks are 0 or more")
        if len(set(value)) != len(value):
            raise ValueError("must not repeat a rank")
        return value

    @field_validator("engine_id")
    @classmethod
    def _check_engine_id(cls, value: str) -> str:
        if not _ENGINE_ID_RE.match(value):
            raise ValueError(
                "must be 1-128 characters of letters, digits, '.', '_', ':' or '-', "
                "starting with a letter or digit"
            )
        return value

    @field_validator("model")
    @classmethod
    def _check_model(cls, value: str) -> str:
        if not _PRESET_RE.match(value):
            raise ValueError("must be a preset name in lower case, e.g. llama-3.1-8b")
        presets = available_presets()
        # Checked only once the presets ship, so this module never depends on their loader.
        if presets and value not in presets:
            close = difflib.get_close_matches(value, presets, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"is not a known preset{hint}; presets: {', '.join(presets)}")
        return value

    @field_validator("admin_host", "control_host")
    @classmethod
    def _check_bind_host(cls, value: str) -> str:
        return _check_host(value)

    @field_validator("advertise_host")
    @classmethod
    def _check_advertise_host(cls, value: str | None) -> str | None:
        if value is None:
            return None
        value = _check_host(value)
        if _is_wildcard(value):
            raise ValueError("must be an address peers can reach, not a wildcard like 0.0.0.0")
        return value

    @field_validator("engine_ipc")
    @classmethod
    def _check_engine_ipc(cls, value: str) -> str:
        if value.startswith("ipc://"):
            if not value[len("ipc://") :].startswith("/"):
                raise ValueError("an ipc:// endpoint needs an absolute path, e.g. ipc:///dev/shm/x")
            return value
        if value.startswith("tcp://"):
            return value
        raise ValueError("must be a ZMQ endpoint starting with ipc:// or tcp://")

    @field_validator("admin_token", "auth_key", "auth_key_file", mode="before")
    @classmethod
    def _blank_token_is_none(cls, value: object) -> object:
        if isinstance(value, str) and not value.strip():
            return None
        return value

    @field_validator("auth_key")
    @classmethod
    def _check_auth_key(cls, value: SecretStr | None) -> SecretStr | None:
        # 32 bytes: the HMAC-SHA256 key size that gives its full strength (app.transfer.wire.auth).
        if value is not None and len(value.get_secret_value().strip().encode()) < 32:
            raise ValueError(
                "must be at least 32 characters; generate one with "
                "`python -c 'import secrets; print(secrets.token_hex(32))'`"
            )
        return value

    @field_validator("max_descriptors_per_submit")
    @classmethod
    def _check_descriptors(cls, value: int) -> int:
        if value < 1:
            raise ValueError("must be at least 1")
        if value > MAX_DESCRIPTORS_HARD_LIMIT:
            raise ValueError(
                f"must be at most {MAX_DESCRIPTORS_HARD_LIMIT}, because a Mooncake batch of 4096 "
                "descriptors to one peer was rejected ('TCP lane queue-full') and left that "
                "engine's session to the peer failing every later call (DESIGN §6); "
                f"{DEFAULT_DESCRIPTORS_PER_SUBMIT} is the tested default"
            )
        return value

    @model_validator(mode="after")
    def _check_together(self) -> SidecarSettings:
        problems: list[str] = []
        outside = [rank for rank in self.ranks if rank >= self.tp_size]
        if outside:
            problems.append(
                f"ranks ({env_var_for('ranks')}) lists {outside} but tp_size "
                f"({env_var_for('tp_size')}) is {self.tp_size}: every rank must be in "
                f"[0, {self.tp_size})."
            )
        ports = {"admin_port": self.admin_port, "control_port": self.control_port}
        if self.mooncake_rpc_port is not None:
            ports["mooncake_rpc_port"] = self.mooncake_rpc_port
        seen: dict[int, str] = {}
        for name, port in ports.items():
            if port == 0:
                continue  # the OS gives each listener its own port
            if port in seen:
                problems.append(
                    f"{name} ({env_var_for(name)}) and {seen[port]} ({env_var_for(seen[port])}) "
                    f"are both {port}: each listener needs its own port."
                )
            seen.setdefault(port, name)
        if self.auth_key_file is not None and self.auth_key is not None:
            problems.append(
                f"auth_key_file ({env_var_for('auth_key_file')}) and auth_key "
                f"({env_var_for('auth_key')}) are both set: set one, so that which key is used "
                "is never a guess."
            )
        if (
            self.auth_key_file is None
            and self.auth_key is None
            and not _is_loopback(self.control_host)
        ):
            problems.append(
                f"control_host ({env_var_for('control_host')}) is {self.control_host}, which "
                "other hosts can reach, but no control-plane key is set: anyone who reaches the "
                "control port could read region addresses and abort or complete requests. Mount "
                "a Secret holding at least 32 random bytes and set "
                f"{env_var_for('auth_key_file')} to its file (k8s/auth-key-secret.example.yaml), "
                f"or set {env_var_for('auth_key')}."
            )
        if self.lease_s < 2 * self.heartbeat_interval_s:
            problems.append(
                f"lease_s ({env_var_for('lease_s')}) is {self.lease_s:g} but heartbeats come "
                f"every {self.heartbeat_interval_s:g} s ({env_var_for('heartbeat_interval_s')}): "
                "the lease must cover at least two heartbeats, or one lost ping declares a "
                "healthy peer dead"
            )
        if problems:
            # One line per problem; format_settings_error turns each into its own sentence.
            raise ValueError("\n".join(problems))
        return self

    # --- derived -----------------------------------------------------------------------------
    def resolved_advertise_host(self) -> str:
        """Address to hand to peers: advertise_host, else control_host unless it is a wildcard."""
        if self.advertise_host:
            return self.advertise_host
        if not _is_wildcard(self.control_host):
            return self.control_host
        try:
            return socket.gethostbyname(socket.gethostname())
        except OSError:
            return "127.0.0.1"

    def warnings(self) -> list[str]:
        """Legal but risky choices, for the CLI to log at start."""
        notes: list[str] = []
        if not _is_loopback(self.admin_host) and self.admin_token is None:
            notes.append(
                f"The admin API binds {self.admin_host} without a token: set "
                f"{env_var_for('admin_token')} so that mutating calls need it."
            )
        notes += unknown_env_vars({env_var_for(name) for name in _known_settings()})
        if self.transport == "rdma" and not self.device_name:
            notes.append(
                f"transport is rdma but {env_var_for('device_name')} is empty: Mooncake will pick "
                "the RDMA devices itself."
            )
        return notes


def _known_settings() -> list[str]:
    names = [name for name in SidecarSettings.model_fields if name != "pool"]
    names += [f"pool.{name}" for name in PoolSettings.model_fields]
    return names
