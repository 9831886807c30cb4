"""The agent's link to the cloud: stored credentials, an httpx client with deadlines, jittered retries on
idempotent calls, and a circuit breaker so an unreachable cloud costs one fast failure, not a hang per request.

Credentials (device id and token, the cloud's artifact-signing keys) are written with mode 0600 by
``tierline edge enroll`` and read at start-up.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx

from shared.atomic import write_atomic
from shared.edge_protocol import EnrollRequest, EnrollResponse, SyncRequest, SyncResponse
from shared.errors import ConfigurationError

logger = logging.getLogger(__name__)

CREDENTIALS_FILE = "credentials.json"
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Credentials:
    cloud_url: str
    device_id: str
    device_token: str
    tenant: str
    signing_public_keys: list[str]
    sync_interval_s: float

    def save(self, state_dir: Path) -> Path:
        """Atomically, mode 0600 from the first byte (the token is a secret)."""
        state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        path = state_dir / CREDENTIALS_FILE
        write_atomic(path, json.dumps(asdict(self), indent=2).encode(), mode=0o600)
        keys = state_dir / "keys"
        keys.mkdir(exist_ok=True)
        for i, pem in enumerate(self.signing_public_keys):
            (keys / f"cloud-signing-{i}.pub").write_text(pem)
        return path

    @classmethod
    def load(cls, state_dir: Path) -> Credentials | None:
        path = state_dir / CREDENTIALS_FILE
        if not path.is_file():
            return None
        if path.stat().st_mode & 0o077:
            raise ConfigurationError(f"{path} is readable by others; chmod 600 it")
        try:
            return cls(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError) as exc:
            raise ConfigurationError(f"cannot read device credentials {path}: {exc}") from exc

    def key_files(self, state_dir: Path) -> list[Path]:
        return [state_dir / "keys" / f"cloud-signing-{i}.pub" for i in range(len(self.signing_public_keys))]


class CloudUnavailableError(Exception):
    """The cloud could not be reached in time (or the breaker is open): answer locally, marked degraded."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class CircuitBreaker:
    """Closed → open after ``failure_threshold`` consecutive failures; after ``reset_after_s`` one probe is
    let through (half-open): success closes it, failure opens it again."""

    def __init__(self, failure_threshold: int = 3, reset_after_s: float = 10.0) -> None:
        self.failure_threshold = failure_threshold
        self.reset_after_s = reset_after_s
        self.failures = 0
        self.opened_at: float | None = None
        self._probing = False

    @property
    def state(self) -> str:
        if self.opened_at is None:
            return "closed"
        return "half-open" if time.monotonic() - self.opened_at >= self.reset_after_s else "open"

    def allow(self) -> bool:
        state = self.state
        if state == "closed":
            return True
        if state == "half-open" and not self._probing:
            self._probing = True
            return True
        return False

    def success(self) -> None:
        self.failures = 0
        self.opened_at = None
        self._probing = False

    def failure(self) -> None:
        self.failures += 1
        self._probing = False
        if self.failures >= self.failure_threshold or self.opened_at is not None:
            if self.opened_at is None:
                logger.warning("cloud unreachable %d times in a row: breaker open", self.failures)
            self.opened_at = time.monotonic()


class CloudLink:
    """Async calls to the cloud with the device credential. Timeouts and breaker on every call."""

    def __init__(
        self,
        creds: Credentials,
        *,
        connect_timeout_s: float = 2.0,
        deadline_s: float = 30.0,
        breaker: CircuitBreaker | None = None,
    ) -> None:
        self.creds = creds
        self.deadline_s = deadline_s
        self.breaker = breaker or CircuitBreaker()
        self.client = httpx.AsyncClient(
            base_url=creds.cloud_url,
            headers={"Authorization": f"Bearer {creds.device_token}"},
            timeout=httpx.Timeout(deadline_s, connect=connect_timeout_s),
        )

    async def aclose(self) -> None:
        await self.client.aclose()

    async def _guarded(self, call: Callable[[], Awaitable[T]]) -> T:
        if not self.breaker.allow():
            raise CloudUnavailableError("cloud-unreachable")
        try:
            result = await asyncio.wait_for(call(), self.deadline_s)
        except (httpx.TransportError, TimeoutError) as exc:
            self.breaker.failure()
            logger.info("cloud call failed: %s", type(exc).__name__)
            raise CloudUnavailableError("cloud-unreachable") from exc
        self.breaker.success()
        return result

    async def escalate(self, endpoint: str, body: dict[str, Any], reason: str, request_id: str) -> httpx.Response:
        """One attempt (inference is not idempotent to retry blindly); a 5xx counts against the breaker."""
        payload = {"endpoint": endpoint, "reason": reason, "request_id": request_id, "body": body}

        async def call() -> httpx.Response:
            r = await self.client.post("/v1/edge/escalate", json=payload)
            if r.status_code >= 500:
                raise httpx.RemoteProtocolError(f"cloud answered {r.status_code}")
            return r

        return await self._guarded(call)

    async def escalate_stream(
        self, endpoint: str, body: dict[str, Any], reason: str, request_id: str
    ) -> tuple[httpx.Response, AsyncIterator[bytes]]:
        """Open a streamed escalation; the response headers are known before the first byte is relayed."""
        payload = {"endpoint": endpoint, "reason": reason, "request_id": request_id, "body": body}

        async def call() -> httpx.Response:
            request = self.client.build_request("POST", "/v1/edge/escalate", json=payload)
            r = await self.client.send(request, stream=True)
            if r.status_code >= 500:
                await r.aclose()
                raise httpx.RemoteProtocolError(f"cloud answered {r.status_code}")
            return r

        response = await self._guarded(call)

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in response.aiter_raw():
                    yield chunk
            finally:
                await response.aclose()

        return response, relay()

    async def shadow(self, batch: dict[str, Any]) -> int:
        """Send one shadow batch (``edge_agent.shadow_sampler``); the status code. Skipped while the breaker is
        open and never counted against it: the quality monitor must not take a device off its cloud."""
        if self.breaker.state != "closed":
            raise CloudUnavailableError("cloud-unreachable")
        try:
            r = await asyncio.wait_for(self.client.post("/v1/edge/shadow", json=batch), self.deadline_s)
        except (httpx.TransportError, TimeoutError) as exc:
            raise CloudUnavailableError("cloud-unreachable") from exc
        if r.status_code >= 500:
            raise CloudUnavailableError(f"cloud answered {r.status_code}")
        if r.status_code >= 400:  # the sampler drops the batch (and pauses on 402, 403, 429): say why
            try:
                error = r.json()["error"]
                logger.info("shadow batch refused (%d %s): %s", r.status_code, error.get("code"), error.get("message"))
            except (ValueError, KeyError, TypeError, AttributeError):
                logger.info("shadow batch refused (%d)", r.status_code)
        return r.status_code

    async def sync(self, request: SyncRequest, attempts: int = 3) -> SyncResponse:
        """Idempotent (records carry ids), so retried with jittered backoff."""
        body = request.model_dump(mode="json")
        for item in body["usage"]:  # a cloud older than the optional field refuses it even as null
            if item.get("subject") is None:
                item.pop("subject", None)
        for attempt in range(attempts):
            try:
                r = await self._guarded(lambda: self.client.post("/v1/edge/sync", json=body))
                if r.status_code >= 500:
                    raise CloudUnavailableError(f"cloud answered {r.status_code}")
                r.raise_for_status()
                return SyncResponse.model_validate(r.json())
            except CloudUnavailableError:
                if attempt == attempts - 1:
                    raise
                await asyncio.sleep(min(8.0, 0.5 * 2**attempt) * random.uniform(0.5, 1.5))
        raise AssertionError("unreachable")


def enroll(cloud_url: str, token: str, name: str, labels: dict[str, str], runtime: dict[str, Any]) -> Credentials:
    """Exchange a one-time enrollment token for a device credential (blocking; used by the CLI)."""
    from importlib.metadata import version

    body = EnrollRequest(
        token=token, name=name, labels=labels, agent_version=version("tierline"), runtime=runtime
    ).model_dump()
    try:
        r = httpx.post(f"{cloud_url.rstrip('/')}/v1/edge/enroll", json=body, timeout=httpx.Timeout(30.0, connect=5.0))
    except httpx.TransportError as exc:
        raise ConfigurationError(f"cannot reach the cloud at {cloud_url}: {type(exc).__name__}") from exc
    if r.status_code != 200:
        try:
            message = r.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = r.text[:200]
        raise ConfigurationError(f"enrollment refused ({r.status_code}): {message}")
    answer = EnrollResponse.model_validate(r.json())
    return Credentials(
        cloud_url=cloud_url.rstrip("/"),
        device_id=answer.device_id,
        device_token=answer.device_token,
        tenant=answer.tenant,
        signing_public_keys=answer.signing_public_keys,
        sync_interval_s=answer.sync_interval_s,
    )
