"""The static backends file: which served models an OpenAI-compatible server answers (``TIERLINE_CLOUD_BACKENDS``).

```json
{"models": {"remote-lm": {"type": "openai", "endpoints": ["http://10.0.0.7:8000", "http://10.0.0.8:8000"],
                          "upstream_model": "meta-llama/Llama-3.1-8B-Instruct", "tokenizer": "/models/llama-3.1-8b",
                          "api_key_env": "VLLM_API_KEY", "max_concurrency": 64}}}
```

Every field is checked at start-up, and a field this file does not know is an error (a typo must not silently
drop a setting). The upstream key comes from an environment variable or a file readable by its owner only
(mode 0600 or stricter); it is never logged.

This file is the operator's, who owns the host: it is trusted as written, so its key may come from any variable
or file and its endpoints may be any address (loopback, a sidecar). A registry version's serving spec, written by
a console admin, shares its fields but not this trust (``shared.backend_spec.ServingSpec``, ``UpstreamSettings``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic import ValidationError as PydanticValidationError

from shared.backend_spec import UpstreamSpec
from shared.errors import ConfigurationError


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class OpenAIBackendConfig(UpstreamSpec):
    """One served model of the backends file: the shared upstream fields (``shared.backend_spec``) and its
    tokenizer directory."""

    type: Literal["openai"]
    tokenizer: Path = Field(description="a directory with the model's tokenizer (admission and fallback counting)")

    def context_length(self) -> int:
        return context_length(self, self.tokenizer)


def context_length(spec: UpstreamSpec, tokenizer: Path) -> int:
    """``max_model_len``, else the tokenizer directory's ``config.json`` ``max_position_embeddings``."""
    if spec.max_model_len is not None:
        return spec.max_model_len
    try:
        config = json.loads((tokenizer / "config.json").read_text())
        return int(config["max_position_embeddings"])
    except (OSError, ValueError, KeyError, TypeError):
        raise ConfigurationError(
            f"backends: {tokenizer}/config.json gives no max_position_embeddings; set max_model_len"
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
