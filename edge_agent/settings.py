"""Edge agent settings: env prefix ``TIERLINE_EDGE_``, optionally a TOML file (``--config edge.toml``)."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

from shared.errors import ConfigurationError


class EdgeSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TIERLINE_EDGE_", extra="forbid")

    host: str = Field("127.0.0.1", description="local API bind address; keep it on loopback unless api_key is set")
    port: int = Field(8402, ge=0, le=65535)
    zoo_dir: Path | None = Field(None, description="built zoo preset to serve (default $TIERLINE_DATA_DIR/zoo/demo)")
    trusted_keys: list[Path] = Field(
        default_factory=list, description="Ed25519 public keys whose signatures the agent accepts"
    )
    num_threads: int = Field(1, ge=1, le=64, description="runtime threads per model")
    min_runtime_agreement: float = Field(
        1.0,
        ge=0,
        le=1,
        description="least greedy agreement with the reference answers (the source checkpoint's reference.json, "
        "else the fp32 ONNX export's) for a runtime/format to be served (edge_agent.runtime_guard; 1.0: the same "
        "greedy outputs on the check prompts)",
    )
    api_key: SecretStr | None = Field(None, description="optional bearer key for the local API")
    cloud_url: str | None = Field(None, description="the cloud tier's base URL")
    cloud_pairs: dict[str, str | None] = Field(
        default_factory=dict,
        description="edge model -> the cloud model it escalates to (null: it answers locally), over the pairings "
        "the cloud sends at sync; an edge model paired by neither never escalates",
    )
    cloud_deadline_s: float = Field(
        30.0, gt=0, description="longest wait for the cloud on an escalation before answering locally"
    )
    breaker_reset_s: float = Field(10.0, gt=0, description="how long an open breaker waits before probing the cloud")
    outbox_max_bytes: int = Field(
        64 << 20, ge=1 << 16, description="outbox bound; telemetry then events may be dropped, usage never"
    )
    enrollment_poll_s: float = Field(
        2.0, gt=0, description="how often the agent looks for new device credentials (`tierline edge enroll`)"
    )
    shutdown_sync_s: float = Field(5.0, ge=0, description="time given to a last sync when the agent stops")
    on_quota_exhausted: Literal["refuse", "escalate"] = Field(
        "refuse",
        description="when the tenant's allowance (told at sync) is used up: refuse with 429 insufficient_quota, "
        "or send every request to the cloud, which enforces the budget itself",
    )
    max_artifact_bytes: int = Field(1 << 30, ge=1 << 10, description="largest model artifact an update may download")
    update_max_bytes_per_s: float | None = Field(
        None, gt=0, description="bandwidth cap for model downloads (None: unlimited)"
    )
    rollback_window_s: float = Field(300.0, gt=0, description="how long a new version is watched after a swap")
    rollback_max_error_rate: float = Field(0.2, ge=0, le=1, description="error rate that rolls a new version back")
    rollback_min_requests: int = Field(20, ge=1, description="requests seen before the error rate counts")
    rollback_block_s: float = Field(
        86400.0,
        gt=0,
        description="how long a version rolled back (or failing its smoke test) stays blocked on this device; the "
        "block is lifted sooner when the cloud desires another version of the model",
    )
    state_dir: Path | None = Field(
        None, description="the agent's own state: credentials, outbox, policies (default $TIERLINE_DATA_DIR/edge)"
    )
    policy_dir: Path | None = Field(
        None, description="calibrated escalation policies, one JSON per model (default <state_dir>/policies)"
    )


def load_edge_settings(config_file: Path | None) -> EdgeSettings:
    """Environment first, then the TOML file's keys (the file wins, so a device's config is explicit)."""
    values: dict[str, object] = {}
    if config_file is not None:
        try:
            values = tomllib.loads(config_file.read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigurationError(f"cannot read edge config {config_file}: {exc}") from exc
    try:
        return EdgeSettings(**values)  # type: ignore[arg-type]
    except ValueError as exc:
        first = str(exc).splitlines()
        raise ConfigurationError(f"invalid edge config: {' '.join(first[:3])}") from exc


def state_dir(settings: EdgeSettings) -> Path:
    from shared.settings import CoreSettings

    return settings.state_dir or CoreSettings().data_dir / "edge"


def policy_dir(settings: EdgeSettings) -> Path:
    return settings.policy_dir or state_dir(settings) / "policies"
