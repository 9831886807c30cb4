"""Service settings: pydantic-settings classes, env prefix ``TIERLINE_``, one class per concern.

Components build the class they need (``CoreSettings()``, ``DatabaseSettings()``...) and copy the fields
they use; nothing reads ``os.environ`` directly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from shared.errors import ConfigurationError

# Values that ship in examples and docs. Refused as secrets unless TIERLINE_ENV=dev.
PLACEHOLDER_SECRETS = frozenset({"", "change-me", "changeme", "secret", "password", "dev-secret", "placeholder"})

Environment = Literal["dev", "production"]


class CoreSettings(BaseSettings):
    """Where the platform keeps its state, and whether it runs in dev mode."""

    model_config = SettingsConfigDict(env_prefix="TIERLINE_", extra="ignore")

    env: Environment = Field("dev", description="'dev' allows placeholder secrets and verbose errors")
    data_dir: Path = Field(Path("./var"), description="state: SQLite file, zoo, keys, artifacts, outbox")
    log_level: str = Field("INFO", description="logging level name")
    log_format: Literal["text", "json"] | None = Field(
        None, description="'json': one JSON object per line, with request ids; default json in production"
    )
    redis_url: str | None = Field(
        None, description="redis://host:port/db shares rate-limit counters across replicas; in memory when unset"
    )

    @property
    def is_dev(self) -> bool:
        return self.env == "dev"

    @property
    def effective_log_format(self) -> str:
        return self.log_format or ("text" if self.is_dev else "json")

    @property
    def zoo_dir(self) -> Path:
        return self.data_dir / "zoo"

    @property
    def keys_dir(self) -> Path:
        return self.data_dir / "keys"

    @property
    def signing_key_path(self) -> Path:
        return self.keys_dir / "artifact-signing.ed25519"


class DatabaseSettings(BaseSettings):
    """The control/data-plane database: SQLite (WAL) in the data dir by default, PostgreSQL in production."""

    model_config = SettingsConfigDict(env_prefix="TIERLINE_", extra="ignore")

    data_dir: Path = Path("./var")
    database_url: str | None = Field(
        None, description="SQLAlchemy URL; default sqlite:///$TIERLINE_DATA_DIR/tierline.db"
    )
    database_echo: bool = False
    database_pool_size: int = Field(10, ge=1, le=200)

    @property
    def url(self) -> str:
        if self.database_url:
            return self.database_url
        return f"sqlite:///{(self.data_dir / 'tierline.db').resolve()}"


class SecretSettings(BaseSettings):
    """Secrets the services sign with. Placeholders are refused outside dev mode."""

    model_config = SettingsConfigDict(env_prefix="TIERLINE_", extra="ignore")

    env: Environment = "dev"
    secret_key: SecretStr = Field(
        SecretStr("change-me"), description="signs console sessions and CSRF tokens; 32+ random chars in production"
    )

    @model_validator(mode="after")
    def _refuse_placeholders(self) -> SecretSettings:
        if self.env != "dev":
            check_secret("TIERLINE_SECRET_KEY", self.secret_key)
        return self


def check_secret(name: str, value: SecretStr, min_length: int = 32) -> None:
    """Raise when a production secret is a placeholder or too short. The value is never echoed."""
    raw = value.get_secret_value()
    if raw.strip().lower() in PLACEHOLDER_SECRETS:
        raise ConfigurationError(f"{name} is a placeholder; set a random value (or TIERLINE_ENV=dev for local use)")
    if len(raw) < min_length:
        raise ConfigurationError(f"{name} is shorter than {min_length} characters")


class ServiceSettings(BaseSettings):
    """Where the cloud API, the console and the edge agent listen (``tierline up`` and the serve commands)."""

    model_config = SettingsConfigDict(env_prefix="TIERLINE_", extra="ignore")

    cloud_host: str = "127.0.0.1"
    cloud_port: int = Field(8400, ge=0, le=65535)
    console_host: str = "127.0.0.1"
    console_port: int = Field(8401, ge=0, le=65535)
    edge_host: str = "127.0.0.1"
    edge_port: int = Field(8402, ge=0, le=65535)
    cloud_url: str | None = Field(None, description="where edge agents reach the cloud; default from cloud host/port")

    @property
    def resolved_cloud_url(self) -> str:
        return self.cloud_url or f"http://{self.cloud_host}:{self.cloud_port}"
