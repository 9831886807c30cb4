"""Cloud tier settings (env prefix ``TIERLINE_CLOUD_``)."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class CloudSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TIERLINE_CLOUD_", extra="ignore")

    zoo_preset: str = Field("demo", description="which built zoo preset the cloud serves")
