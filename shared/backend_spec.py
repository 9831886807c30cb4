"""What an ``openai`` backend is: the upstream OpenAI-compatible servers that answer a served model.

One schema for both places a backend is declared: the gateway's static backends file (``cloud.backends.config``,
``TIERLINE_CLOUD_BACKENDS``) and a registry version's serving spec (``controlplane.registry.service.set_serving``,
``tierline models serving``). Every field is checked and a field the schema does not know is an error (a typo must
not silently drop a setting). The upstream key comes from an environment variable or a file readable by its owner
only (mode 0600 or stricter); the spec holds only where to read it, never the key.

Options beyond the endpoints:

- ``resolve_dns``: an endpoint given by host name is resolved again every ``probe_interval_s``; each IPv4 address
  (A record) is one endpoint (a Kubernetes headless service lists one per pod), sent the host name in ``Host``.
  Plain ``http`` only: with TLS the certificate names the host, not its addresses.
- ``affinity_prefix_chars``: prefix affinity. The tenant and the first N characters of the prompt pick a preferred
  endpoint (consistent hashing), so requests sharing a prefix find it cached; the preferred endpoint is taken only
  while its load is below ``affinity_load_factor`` times the pool's mean (bounded-load consistent hashing),
  otherwise the least loaded one is.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, HttpUrl, field_validator, model_validator

from shared.errors import ConfigurationError


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class UpstreamSpec(_Strict):
    endpoints: list[HttpUrl] = Field(min_length=1, description="server roots: POST {root}/v1/chat/completions")
    upstream_model: str = Field(min_length=1, description="the model name the upstream serves it under")
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
    resolve_dns: bool = Field(
        False, description="resolve host names again every probe_interval_s; one endpoint per IPv4 address"
    )
    affinity_prefix_chars: int = Field(
        0, ge=0, le=65536, description="prefix affinity on the tenant and this many prompt characters (0: off)"
    )
    affinity_load_factor: float = Field(
        1.25, ge=1.0, description="the preferred endpoint is skipped above this multiple of the mean load"
    )

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
    def _consistent(self) -> UpstreamSpec:
        if self.api_key_env and self.api_key_file:
            raise ValueError("give api_key_env or api_key_file, not both")
        if self.resolve_dns and any(u.scheme != "http" for u in self.endpoints):
            raise ValueError("resolve_dns: endpoints must be plain http (TLS names the host, not its addresses)")
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


class ServingSpec(UpstreamSpec):
    """A registry version's serving spec: its tokenizer is the version's own ``hf-tokenizer`` (or checkpoint)
    artifact."""

    backend: Literal["openai"]

    def without_endpoints(self) -> dict[str, object]:
        """Everything but the endpoint list: what, when it changes, needs a new backend rather than a diff."""
        return self.model_dump(mode="json", exclude={"endpoints"})
