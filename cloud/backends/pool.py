"""A replica pool per backend: which endpoint a request goes to, and which endpoints are out.

- **Balancing**: least outstanding requests among admitted endpoints below their concurrency bound (ties: the
  endpoint used longest ago), so a slow replica gets fewer requests.
- **Passive ejection** (a breaker per endpoint): ``eject_after_failures`` consecutive failures (connection
  refused or reset, timeouts, 5xx) eject it; a success resets the count.
- **Active re-admission**: after ``eject_s``, an ejected endpoint is probed (``GET {root}{health_path}``) every
  ``probe_interval_s``; a 200 admits it again.
- A request waits up to ``queue_timeout_s`` for a slot when every admitted endpoint is at its bound; with no
  admitted endpoint it gets 503 with ``Retry-After`` at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from shared.errors import ServiceUnavailableError

logger = logging.getLogger(__name__)


class UpstreamUnavailableError(ServiceUnavailableError):
    """503: no endpoint of the backend can take the request now; ``Retry-After`` says when to try again."""

    def __init__(self, message: str, *, retry_after: float = 1.0, code: str | None = None) -> None:
        super().__init__(message, code=code)
        self.retry_after = retry_after


class BadGatewayError(ServiceUnavailableError):
    """502: the upstream failed the request (connection lost, 5xx) and no other endpoint could take it."""

    status_code = 502
    code = "upstream_error"

    def __init__(self, message: str, *, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


@dataclass(slots=True)
class Endpoint:
    root: str
    max_concurrency: int
    outstanding: int = 0
    consecutive_failures: int = 0
    ejected_at: float | None = None  # monotonic; None: admitted
    last_used: float = 0.0
    requests: int = 0
    failures: int = 0
    ejections: int = 0

    @property
    def admitted(self) -> bool:
        return self.ejected_at is None


@dataclass(slots=True)
class ReplicaPool:
    model_id: str
    endpoints: list[Endpoint]
    eject_after_failures: int = 3
    eject_s: float = 5.0
    probe_interval_s: float = 1.0
    queue_timeout_s: float = 30.0
    health_path: str = "/health"
    waiting: int = 0  # requests waiting here for a free slot (the gateway's queue for this model)
    _freed: asyncio.Event = field(default_factory=asyncio.Event)
    _prober: asyncio.Task[None] | None = None

    # -- choosing ------------------------------------------------------------------------------------------------
    def _pick(self, exclude: set[str]) -> Endpoint | None:
        ready = [
            e for e in self.endpoints if e.admitted and e.root not in exclude and e.outstanding < e.max_concurrency
        ]
        if not ready:
            return None
        return min(ready, key=lambda e: (e.outstanding, e.last_used))

    def _retry_after(self) -> float:
        now = time.monotonic()
        waits = [max(0.0, e.ejected_at + self.eject_s - now) for e in self.endpoints if e.ejected_at is not None]
        return max(1.0, min(waits, default=1.0) + self.probe_interval_s)

    async def acquire(self, exclude: set[str] | None = None) -> Endpoint:
        """An endpoint with a free slot (its ``outstanding`` counted); ``release`` it when done."""
        exclude = exclude or set()
        deadline = time.monotonic() + self.queue_timeout_s
        while True:
            endpoint = self._pick(exclude)
            if endpoint is not None:
                endpoint.outstanding += 1
                endpoint.requests += 1
                endpoint.last_used = time.monotonic()
                return endpoint
            candidates = [e for e in self.endpoints if e.admitted and e.root not in exclude]
            if not candidates:
                raise UpstreamUnavailableError(
                    f"model '{self.model_id}': no healthy upstream endpoint", retry_after=self._retry_after()
                )
            left = deadline - time.monotonic()
            if left <= 0:
                raise UpstreamUnavailableError(
                    f"model '{self.model_id}': every upstream endpoint is at its concurrency bound", retry_after=1.0
                )
            self._freed.clear()
            self.waiting += 1
            try:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._freed.wait(), left)
            finally:
                self.waiting -= 1

    def release(self, endpoint: Endpoint, ok: bool | None) -> None:
        """The request on ``endpoint`` is over: ``ok`` True (success), False (the endpoint failed), None (neither:
        the client left, or the upstream refused the request with a 4xx)."""
        endpoint.outstanding -= 1
        if ok is True:
            endpoint.consecutive_failures = 0
        elif ok is False:
            self.failed(endpoint)
        self._freed.set()

    def failed(self, endpoint: Endpoint) -> None:
        endpoint.failures += 1
        endpoint.consecutive_failures += 1
        if endpoint.admitted and endpoint.consecutive_failures >= self.eject_after_failures:
            endpoint.ejected_at = time.monotonic()
            endpoint.ejections += 1
            logger.warning(
                "backend %s: endpoint %s ejected after %d consecutive failures",
                self.model_id,
                endpoint.root,
                endpoint.consecutive_failures,
            )

    # -- re-admission --------------------------------------------------------------------------------------------
    def start(self, client: httpx.AsyncClient) -> None:
        self._prober = asyncio.create_task(self._probe_loop(client), name=f"backend-probe-{self.model_id}")

    async def close(self) -> None:
        if self._prober is not None:
            self._prober.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._prober
            self._prober = None

    async def _probe_loop(self, client: httpx.AsyncClient) -> None:
        while True:
            await asyncio.sleep(self.probe_interval_s)
            now = time.monotonic()
            due = [e for e in self.endpoints if e.ejected_at is not None and now - e.ejected_at >= self.eject_s]
            if due:
                await asyncio.gather(*(self.probe(client, e) for e in due))

    async def probe(self, client: httpx.AsyncClient, endpoint: Endpoint) -> bool:
        """One active health check; a 200 admits ``endpoint`` again."""
        try:
            response = await client.get(f"{endpoint.root}{self.health_path}", timeout=2.0)
            healthy = response.status_code == 200
        except httpx.HTTPError:
            healthy = False
        if healthy and endpoint.ejected_at is not None:
            endpoint.ejected_at = None
            endpoint.consecutive_failures = 0
            logger.warning("backend %s: endpoint %s re-admitted (health probe)", self.model_id, endpoint.root)
            self._freed.set()
        return healthy


class PoolCollector:
    """Per-endpoint gauges and counters for ``/metrics`` (read at scrape time)."""

    def __init__(self, pools: list[ReplicaPool]) -> None:
        self.pools = pools

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        labels = ["model", "endpoint"]
        outstanding = GaugeMetricFamily(
            "tierline_backend_outstanding_requests", "Requests in flight to the endpoint", labels=labels
        )
        up = GaugeMetricFamily("tierline_backend_endpoint_admitted", "1: in rotation, 0: ejected", labels=labels)
        requests = CounterMetricFamily("tierline_backend_requests", "Requests sent to the endpoint", labels=labels)
        failures = CounterMetricFamily("tierline_backend_failures", "Failed requests (5xx, connection)", labels=labels)
        ejections = CounterMetricFamily("tierline_backend_ejections", "Times the breaker ejected it", labels=labels)
        waiting = GaugeMetricFamily(
            "tierline_backend_waiting_requests",
            "Requests waiting in the gateway for a free upstream slot (every endpoint at max_concurrency)",
            labels=["model"],
        )
        for pool in self.pools:
            waiting.add_metric([pool.model_id], pool.waiting)
            for e in pool.endpoints:
                key = [pool.model_id, e.root]
                outstanding.add_metric(key, e.outstanding)
                up.add_metric(key, 1.0 if e.admitted else 0.0)
                requests.add_metric(key, e.requests)
                failures.add_metric(key, e.failures)
                ejections.add_metric(key, e.ejections)
        yield from (outstanding, up, requests, failures, ejections, waiting)
