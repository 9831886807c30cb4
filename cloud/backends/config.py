"""The static backends file: which served models an OpenAI-compatible server answers (``TIERLINE_CLOUD_BACKENDS``).

```json
{"models": {"remote-lm": {"type": "openai", "endpoints": ["http://10.0.0.7:8000", "http://10.0.0.8:8000"],
                          "upstream_model": "meta-llama/Llama-3.1-8B-Instruct", "tokenizer": "/models/llama-3.1-8b",
                          "api_key_env": "VLLM_API_KEY", "max_concurrency": 64}}}
```

Every field is checked at start-up, and a field this file does not know is an error (a typo must not silently
drop a setting). The upstream key comes from an environment variable or a file readable by its owner only
(mode 0600 or stricter); it is never logged.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, HttpUrl, field_validator, model_validator
from pydantic import ValidationError as PydanticValidationError

from shared.errors import ConfigurationError


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class OpenAIBackendConfig(_Strict):
    type: Literal["openai"]
    endpoints: list[HttpUrl] = Field(min_length=1, description="server roots: POST {root}/v1/chat/completions")
    upstream_model: str = Field(min_length=1, description="the model name the upstream serves it under")
    tokenizer: Path = Field(description="a directory with the model's tokenizer (admission and fallback counting)")
    max_model_len: int | None = Field(None, ge=1, description="context length (default: the tokenizer's config.json)")
    api_key_env: str | None = Field(None, min_length=1, description="environment variable holding the upstream key")
    api_key_file: Path | None = Field(None, description="a file holding the upstream key (mode 0600 or stricter)")
    max_concurrency: int = Field(32, ge=1, description="requests in flight per endpoint at most")
    connect_timeout_s: float = Field(2.0, gt=0)
    queue_timeout_s: float = Field(30.0, gt=0, description="wait for a free slot on a healthy endpoint at most")
    eject_after_failures: int = Field(3, ge=1, description="consecutive failures that eject an endpoint")
    eject_s: float = Field(5.0, gt=0, description="cool-down before an ejected endpoint is probed again")
    probe_interval_s: float = Field(1.0, gt=0, description="how often ejected endpoints past cool-down are probed")
    health_path: str = Field("/health", pattern=r"^/")

    @field_validator("endpoints")
    @classmethod
    def _roots(cls, v: list[HttpUrl]) -> list[HttpUrl]:
        for url in v:
            if url.query or url.fragment:
                raise ValueError(f"endpoint {url}: no query or fragment")
        if len({str(u) for u in v}) != len(v):
            raise ValueError("endpoints: listed twice")
        return v

    @model_validator(mode="after")
    def _one_key_source(self) -> OpenAIBackendConfig:
        if self.api_key_env and self.api_key_file:
            raise ValueError("give api_key_env or api_key_file, not both")
        return self

    def roots(self) -> list[str]:
        return [str(u).rstrip("/") for u in self.endpoints]

    def api_key(self) -> str | None:
        """The upstream key, read now (None: the upstream needs none)."""
        if self.api_key_env:
            key = os.environ.get(self.api_key_env)
            if not key:
                raise ConfigurationError(f"backends: environment variable {self.api_key_env} is not set")
            return key.strip()
        if self.api_key_file is None:
            return None
        try:
            info = self.api_key_file.stat()
        except OSError as exc:
            raise ConfigurationError(f"backends: cannot read api_key_file {self.api_key_file}: {exc}") from None
        if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise ConfigurationError(
                f"backends: api_key_file {self.api_key_file} is readable by others "
                f"(mode {stat.S_IMODE(info.st_mode):o}); chmod 600 it"
            )
        key = self.api_key_file.read_text().strip()
        if not key:
            raise ConfigurationError(f"backends: api_key_file {self.api_key_file} is empty")
        return key

    def context_length(self) -> int:
        if self.max_model_len is not None:
            return self.max_model_len
        try:
            config = json.loads((self.tokenizer / "config.json").read_text())
            return int(config["max_position_embeddings"])
        except (OSError, ValueError, KeyError, TypeError):
            raise ConfigurationError(
                f"backends: {self.tokenizer}/config.json gives no max_position_embeddings; set max_model_len"
            ) from None


class BackendsFile(_Strict):
    models: dict[str, OpenAIBackendConfig] = Field(default_factory=dict)

    @field_validator("models")
    @classmethod
    def _names(cls, v: dict[str, OpenAIBackendConfig]) -> dict[str, OpenAIBackendConfig]:
        for name in v:
            if not name or "@" in name or len(name) > 128:
                raise ValueError(f"model id '{name}': 1-128 characters, no '@'")
        return v


def load_backends(path: Path) -> BackendsFile:
    """The file at ``path``, checked; ConfigurationError naming the file and the field otherwise."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigurationError(f"TIERLINE_CLOUD_BACKENDS: cannot read {path}: {exc}") from None
    try:
        return BackendsFile.model_validate_json(text)
    except PydanticValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ConfigurationError(f"{path}: {where}: {first['msg']}") from None
