"""What an ``openai`` backend is: the upstream OpenAI-compatible servers that answer a served model.

One schema for both places a backend is declared, at two levels of trust:

- the gateway's static backends file (``cloud.serving.backends.config``, ``TIERLINE_CLOUD_BACKENDS``) is written by the
  operator, who owns the host: its upstream key may come from any environment variable or any file (mode 0600 or
  stricter), and its endpoints may be any address (``UpstreamSpec``);
- a registry version's serving spec (``controlplane.registry.service.set_serving``, ``tierline models serving``,
  the console) is written by a console admin, who does not hold the host's environment (``ServingSpec``): its key
  comes only from where the operator designates (``UpstreamSettings``, env prefix ``TIERLINE_CLOUD_UPSTREAM_``): a
  file named by its bare name inside ``TIERLINE_CLOUD_UPSTREAM_SECRETS_DIR`` (no path separators, no ``..``, a
  symlink must stay inside), or an environment variable whose name starts with
  ``TIERLINE_CLOUD_UPSTREAM_KEY_ENV_PREFIX`` (default ``TIERLINE_UPSTREAM_KEY_``); and its endpoints must pass the
  operator's egress policy (``shared.egress.EgressPolicy``: no metadata or link-local address, none of the cloud's
  own database, Redis or listeners, loopback only when allowed). Both are checked when the spec is submitted (400
  naming the field and the rule) and again whenever the gateway builds or re-resolves its backend, so a spec stored
  before these rules, or written to the database by hand, is not served either.

Every field is checked and a field the schema does not know is an error (a typo must not silently drop a setting).
The spec holds only where to read the upstream key, never the key.

Options beyond the endpoints:

- ``resolve_dns``: an endpoint given by host name is resolved again every ``probe_interval_s``; each IPv4 address
  (A record) is one endpoint (a Kubernetes headless service lists one per pod), sent the host name in ``Host``.
  Plain ``http`` only: with TLS the certificate names the host, not its addresses.
- ``affinity_prefix_chars``: prefix affinity. The tenant and the first N characters of the prompt pick a preferred
  endpoint (consistent hashing), so requests sharing a prefix find it cached; the preferred endpoint is taken only
  while its load is below ``affinity_load_factor`` times the pool's mean (bounded-load consistent hashing),
  otherwise the least loaded one is.

A serving spec's endpoint given by host name is pinned: the gateway resolves it when it builds the backend and
again every ``probe_interval_s``, checks every address, and connects to a checked address (the first; every IPv4
one with ``resolve_dns``), sending the name as ``Host`` and as the TLS server name.
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Literal

from pydantic import BaseModel, ConfigDict, Field, HttpUrl, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from shared.egress import EgressPolicy, egress_endpoints
from shared.errors import ConfigurationError
from shared.settings import CoreSettings, DatabaseSettings, ServiceSettings

KEY_FILE_NAME: Final = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")
ENV_NAME: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# Variables the platform reads as its own secrets: no key prefix may reach them.
PLATFORM_SECRETS: Final = ("TIERLINE_SECRET_KEY", "TIERLINE_DATABASE_URL", "TIERLINE_REDIS_URL")


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

    def api_key(self, keys: KeySources | None = None) -> str | None:
        """The upstream key, read now (None: the upstream needs none). ``keys`` None: the operator's trust (the
        backends file: any variable, any file); else only from the places ``keys`` designates."""
        if keys is not None:
            return keys.read(self)
        if self.api_key_env:
            return _env_key(self.api_key_env)
        return None if self.api_key_file is None else _file_key(self.api_key_file)


def _env_key(name: str) -> str:
    key = os.environ.get(name)
    if not key:
        raise ConfigurationError(f"backends: environment variable {name} is not set")
    return key.strip()


def _file_key(path: Path, shown: Path | None = None) -> str:
    shown = shown or path
    try:
        info = path.stat()
    except OSError as exc:
        raise ConfigurationError(f"backends: cannot read api_key_file {shown}: {exc.strerror}") from None
    if not stat.S_ISREG(info.st_mode):
        raise ConfigurationError(f"backends: api_key_file {shown} is not a regular file")
    if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigurationError(
            f"backends: api_key_file {shown} is readable by others (mode {stat.S_IMODE(info.st_mode):o}); chmod 600 it"
        )
    key = path.read_text().strip()
    if not key:
        raise ConfigurationError(f"backends: api_key_file {shown} is empty")
    return key


@dataclass(frozen=True, slots=True)
class KeySources:
    """Where a serving spec's upstream key may come from: files in ``secrets_dir`` (by bare name) and environment
    variables whose name starts with ``env_prefix``. Nothing else."""

    secrets_dir: Path | None
    env_prefix: str

    def problem(self, spec: UpstreamSpec) -> tuple[str, str] | None:
        """``(field, why)`` when ``spec`` names its key anywhere else; None when it does not."""
        if spec.api_key_env is not None:
            name = spec.api_key_env
            if not (ENV_NAME.fullmatch(name) and name.startswith(self.env_prefix) and len(name) > len(self.env_prefix)):
                return "api_key_env", (
                    f"{name!r} is not an upstream key variable: a serving spec may name only environment variables "
                    f"whose name starts with {self.env_prefix} (the operator's TIERLINE_CLOUD_UPSTREAM_KEY_ENV_PREFIX)"
                )
        if spec.api_key_file is not None and not KEY_FILE_NAME.fullmatch(str(spec.api_key_file)):
            return "api_key_file", (
                f"{str(spec.api_key_file)!r} is a path: a serving spec names a file of the operator's secrets "
                "directory (TIERLINE_CLOUD_UPSTREAM_SECRETS_DIR) by its bare name (no '/', no '..')"
            )
        return None

    def read(self, spec: UpstreamSpec) -> str | None:
        """The key from a designated place; ConfigurationError naming the rule otherwise."""
        if (problem := self.problem(spec)) is not None:
            raise ConfigurationError(f"serving.{problem[0]}: {problem[1]}")
        if spec.api_key_env is not None:
            return _env_key(spec.api_key_env)
        if spec.api_key_file is None:
            return None
        if self.secrets_dir is None:
            raise ConfigurationError(
                f"serving.api_key_file: {spec.api_key_file} names a secrets file, but the operator designates no "
                "secrets directory (TIERLINE_CLOUD_UPSTREAM_SECRETS_DIR)"
            )
        root = self.secrets_dir.resolve()
        try:
            path = (root / spec.api_key_file).resolve(strict=True)
        except OSError as exc:
            raise ConfigurationError(
                f"backends: cannot read api_key_file {spec.api_key_file}: {exc.strerror}"
            ) from None
        if not path.is_relative_to(root):
            raise ConfigurationError(
                f"serving.api_key_file: {spec.api_key_file} leads out of the secrets directory (a symlink)"
            )
        return _file_key(path, shown=spec.api_key_file)


class UpstreamSettings(BaseSettings):
    """What the operator lets a registry serving spec reach (env prefix ``TIERLINE_CLOUD_UPSTREAM_``): read by the
    console and the CLI when a spec is submitted, and by the gateway when it builds and re-resolves a backend."""

    model_config = SettingsConfigDict(env_prefix="TIERLINE_CLOUD_UPSTREAM_", extra="ignore")

    secrets_dir: Path | None = Field(
        None, description="a directory of upstream key files, each named by its bare name in a serving spec"
    )
    key_env_prefix: str = Field(
        "TIERLINE_UPSTREAM_KEY_",
        description="a serving spec's api_key_env must start with this (used for nothing else)",
    )
    allow_loopback: bool = Field(False, description="serving specs may name loopback addresses (a one-host setup)")
    allow: str = Field(
        "",
        description="comma-separated networks (CIDR) and host names: when set, a serving spec's endpoints must be "
        "in it (loopback included); empty: any address but the refused ones",
    )

    @field_validator("key_env_prefix")
    @classmethod
    def _prefix(cls, v: str) -> str:
        if not (ENV_NAME.fullmatch(v) and v.endswith("_") and len(v) >= 4):
            raise ValueError("an environment variable name prefix ending with '_' (4+ characters)")
        if any(name.startswith(v) for name in PLATFORM_SECRETS):
            raise ValueError(f"{v} would let a serving spec read the platform's own secrets")
        return v

    @field_validator("allow")
    @classmethod
    def _allow(cls, v: str) -> str:
        EgressPolicy.parse_allow(v)
        return v

    def key_sources(self) -> KeySources:
        return KeySources(self.secrets_dir, self.key_env_prefix)

    def egress(self, *, check_own_sockets: bool) -> EgressPolicy:
        """The endpoint rules, the cloud's own database, Redis and listeners refused (``check_own_sockets``: also
        whatever this process listens on: the gateway's own check)."""
        services = ServiceSettings()
        own = egress_endpoints([DatabaseSettings().url, CoreSettings().redis_url or ""])
        listeners = ((services.cloud_host, services.cloud_port), (services.console_host, services.console_port))
        return EgressPolicy(
            allow_loopback=self.allow_loopback,
            allow=EgressPolicy.parse_allow(self.allow),
            own=(*own, *listeners, (services.edge_host, services.edge_port)),
            check_own_sockets=check_own_sockets,
        )


def load_upstream_settings() -> UpstreamSettings:
    """``UpstreamSettings()``; ConfigurationError naming the variable when one is invalid."""
    try:
        return UpstreamSettings()
    except ValueError as exc:
        raise ConfigurationError(f"TIERLINE_CLOUD_UPSTREAM_*: {exc}") from None


class ServingSpec(UpstreamSpec):
    """A registry version's serving spec: its tokenizer is the version's own ``hf-tokenizer`` (or checkpoint)
    artifact. Written by a console admin: its key and endpoints are held to the operator's ``UpstreamSettings``
    (``boundary_problem``)."""

    backend: Literal["openai"]

    def without_endpoints(self) -> dict[str, object]:
        """Everything but the endpoint list: what, when it changes, needs a new backend rather than a diff."""
        return self.model_dump(mode="json", exclude={"endpoints"})

    def api_key(self, keys: KeySources | None = None) -> str | None:
        """The upstream key, only ever from the places the operator designates (``keys``, else the settings)."""
        return super().api_key(keys if keys is not None else load_upstream_settings().key_sources())


def boundary_problem(spec: ServingSpec, keys: KeySources, egress: EgressPolicy) -> tuple[str, str] | None:
    """``(field, why)`` when ``spec`` reaches past what the operator designates: a key from elsewhere, or an endpoint
    the egress policy refuses (host names resolved now, blocking: one that does not resolve passes here and is
    checked again when the gateway resolves it); None when it does not."""
    if (problem := keys.problem(spec)) is not None:
        return problem
    for i, root in enumerate(spec.roots()):
        _, why = egress.resolve(root)
        if why is not None:
            return f"endpoints.{i}", f"{root} is refused: {why}"
    return None
