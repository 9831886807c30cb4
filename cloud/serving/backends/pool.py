"""A replica pool per backend: which endpoint a request goes to, and which endpoints are out.

- **Balancing**: least outstanding requests among admitted endpoints below their concurrency bound (ties: the
  endpoint used longest ago), so a slow replica gets fewer requests.
- **Passive ejection** (a breaker per endpoint): ``eject_after_failures`` consecutive failures (connection
  refused or reset, timeouts, 5xx) eject it; a success resets the count.
- **Active re-admission**: after ``eject_s``, an ejected endpoint is probed (``GET {root}{health_path}``) every
  ``probe_interval_s``; a 200 admits it again.
- A request waits up to ``queue_timeout_s`` for a slot when every admitted endpoint is at its bound; with no
  admitted endpoint it gets 503 with ``Retry-After`` at once.
- **Prefix affinity** (``affinity_prefix_chars`` > 0): a request's key (tenant and prompt prefix) ranks the
  endpoints by rendezvous hashing; the first in that order whose load stays within ``affinity_load_factor`` times
  the mean load (bounded-load consistent hashing) takes it. Taking the first-ranked one is an affinity hit.
- **Endpoint lists change without a restart** (``set_endpoints``): a new endpoint takes requests at once; one that
  left is *draining*: it takes no new request, its requests in flight finish, then it leaves the pool.
- **DNS** (``resolve_dns``): the configured host names are resolved again every ``probe_interval_s``; each IPv4
  address is an endpoint (requests carry the host name in ``Host``), and the address list is applied as above.
- **Egress** (``egress``: a registry version's serving spec, written by a console admin): every configured root is
  checked against the operator's ``shared.egress.EgressPolicy`` when the pool is built and again every
  ``probe_interval_s``; a host name is resolved and every address checked each time, and the endpoint is the
  checked address (the first, or every IPv4 one with ``resolve_dns``) with the name sent as ``Host`` and as the TLS
  server name: a name that starts resolving to a refused address (DNS rebinding) is dropped, never connected to.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import ipaddress
import logging
import math
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httpx
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from shared.egress import EgressPolicy
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
    host: str | None = None  # the Host header to send (an address resolved from a host name), else the root's
    draining: bool = False  # left the endpoint list: no new requests; dropped once ``outstanding`` is 0
    outstanding: int = 0
    consecutive_failures: int = 0
    ejected_at: float | None = None  # monotonic; None: admitted
    last_used: float = 0.0
    requests: int = 0
    failures: int = 0
    ejections: int = 0
    affinity_hits: int = 0

    @property
    def admitted(self) -> bool:
        return self.ejected_at is None


def _rank(key: str, root: str) -> bytes:
    return hashlib.blake2b(f"{key}\x00{root}".encode(), digest_size=8).digest()


def resolve_roots(sources: list[str]) -> list[tuple[str, str | None]]:
    """``(root, Host header)`` per IPv4 address of each source's host name (blocking: ``getaddrinfo``); a source
    that is an address already is itself. A name that does not resolve now gives nothing (logged)."""
    out: list[tuple[str, str | None]] = []
    for source in sources:
        parts = urlsplit(source)
        host, port = parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80)
        try:
            ipaddress.ip_address(host)
            out.append((source, None))  # an address already (IPv4 or IPv6)
            continue
        except ValueError:
            pass
        try:
            infos = socket.getaddrinfo(host, port, socket.AF_INET, socket.SOCK_STREAM)
        except OSError as exc:
            logger.warning("backend endpoint %s: %s does not resolve (%s)", source, host, exc)
            continue
        for address in sorted({str(info[4][0]) for info in infos}):
            root = f"{parts.scheme}://{address}:{port}{parts.path}".rstrip("/")
            out.append((root, parts.netloc))
    return out


def pinned_roots(
    sources: list[str], egress: EgressPolicy, every_address: bool
) -> tuple[list[tuple[str, str | None]], list[str]]:
    """``(root, Host header)`` per checked address of each source (blocking: ``getaddrinfo``): the first address of
    a host name, or every IPv4 one with ``every_address``; a source that is an address already is itself. Also the
    sources refused, each with why (none of their addresses is used). A name that does not resolve now gives
    nothing (logged)."""
    out: list[tuple[str, str | None]] = []
    refused: list[str] = []
    for source in sources:
        addresses, why = egress.resolve(source)
        if why is not None:
            refused.append(f"{source} is refused: {why}")
            continue
        parts = urlsplit(source)
        host, port = parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80)
        if not addresses:
            logger.warning("backend endpoint %s: %s does not resolve", source, host)
            continue
        try:
            ipaddress.ip_address(host)
            out.append((source, None))  # an address already, checked
            continue
        except ValueError:
            pass
        chosen = [a for a in addresses if a.version == 4] if every_address else addresses[:1]
        for address in chosen:
            literal = f"[{address}]" if address.version == 6 else str(address)
            out.append((f"{parts.scheme}://{literal}:{port}{parts.path}".rstrip("/"), parts.netloc))
    return out, refused


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
    affinity_load_factor: float = 1.25
    resolve_dns: bool = False
    sources: list[str] = field(default_factory=list)  # the configured roots (host names when ``resolve_dns``)
    endpoint_concurrency: int = 32  # an endpoint a DNS answer adds gets this bound
    affinity_misses: int = 0  # requests with a key that went elsewhere than their first-ranked endpoint
    egress: EgressPolicy | None = None  # set: every root checked (and host names pinned) at each resolution
    _refused: frozenset[str] = frozenset()  # the refusals last logged
    _freed: asyncio.Event = field(default_factory=asyncio.Event)
    _prober: asyncio.Task[None] | None = None

    # -- choosing ------------------------------------------------------------------------------------------------
    def _pick(self, exclude: set[str], key: str | None = None) -> Endpoint | None:
        live = [e for e in self.endpoints if e.admitted and not e.draining and e.root not in exclude]
        ready = [e for e in live if e.outstanding < e.max_concurrency]
        if not ready:
            return None
        if key is not None:
            ranked = sorted(live, key=lambda e: _rank(key, e.root), reverse=True)
            bound = math.ceil(self.affinity_load_factor * (sum(e.outstanding for e in live) + 1) / len(live))
            for e in ranked:
                if e.outstanding < e.max_concurrency and e.outstanding + 1 <= bound:
                    if e is ranked[0]:
                        e.affinity_hits += 1
                    else:
                        self.affinity_misses += 1
                    return e
            self.affinity_misses += 1
        return min(ready, key=lambda e: (e.outstanding, e.last_used))

    def _retry_after(self) -> float:
        now = time.monotonic()
        waits = [max(0.0, e.ejected_at + self.eject_s - now) for e in self.endpoints if e.ejected_at is not None]
        return max(1.0, min(waits, default=1.0) + self.probe_interval_s)

    async def acquire(self, exclude: set[str] | None = None, key: str | None = None) -> Endpoint:
        """An endpoint with a free slot (its ``outstanding`` counted); ``release`` it when done. ``key``: the
        request's affinity key (None: least outstanding requests)."""
        exclude = exclude or set()
        deadline = time.monotonic() + self.queue_timeout_s
        while True:
            endpoint = self._pick(exclude, key)
            if endpoint is not None:
                endpoint.outstanding += 1
                endpoint.requests += 1
                endpoint.last_used = time.monotonic()
                return endpoint
            candidates = [e for e in self.endpoints if e.admitted and not e.draining and e.root not in exclude]
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
        if endpoint.draining and endpoint.outstanding == 0:
            self._drop(endpoint)
        self._freed.set()

    # -- changing the endpoint list (on the event loop) -------------------------------------------------------
    def set_endpoints(self, roots: list[tuple[str, str | None]], max_concurrency: int) -> None:
        """Make the pool's endpoints ``roots`` (``(root, Host header)``): new ones join at once, one that left
        drains (no new requests; dropped when its last request ends), one that came back stops draining."""
        wanted = dict(roots)
        for e in list(self.endpoints):
            if e.root in wanted:
                if e.draining:
                    logger.warning("backend %s: endpoint %s is back; no longer draining", self.model_id, e.root)
                e.draining, e.host, e.max_concurrency = False, wanted.pop(e.root), max_concurrency
            elif not e.draining:
                e.draining = True
                logger.warning(
                    "backend %s: endpoint %s left the list; draining (%d in flight)",
                    self.model_id,
                    e.root,
                    e.outstanding,
                )
                if e.outstanding == 0:
                    self._drop(e)
        for root, host in wanted.items():
            self.endpoints.append(Endpoint(root, max_concurrency, host=host))
            logger.warning("backend %s: endpoint %s joined", self.model_id, root)
        self._freed.set()

    def drain_all(self) -> None:
        """The whole pool is going away: every endpoint drains."""
        self.set_endpoints([], 1)

    @property
    def drained(self) -> bool:
        return not self.endpoints

    def _drop(self, endpoint: Endpoint) -> None:
        if endpoint in self.endpoints:
            self.endpoints.remove(endpoint)
            logger.warning("backend %s: endpoint %s drained and removed", self.model_id, endpoint.root)

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
            if (self.resolve_dns or self.egress is not None) and self.sources:
                await self.resolve()
            now = time.monotonic()
            due = [e for e in self.endpoints if e.ejected_at is not None and now - e.ejected_at >= self.eject_s]
            if due:
                await asyncio.gather(*(self.probe(client, e) for e in due))

    async def resolve(self) -> None:
        """Resolve the configured host names again and apply the addresses (``resolve_dns``; with ``egress``: every
        root checked, host names pinned to checked addresses)."""
        sources = list(self.sources)
        if self.egress is not None:
            roots, refused = await asyncio.to_thread(pinned_roots, sources, self.egress, self.resolve_dns)
            if frozenset(refused) != self._refused:
                for why in refused:
                    logger.error("backend %s: endpoint %s; not used", self.model_id, why)
                self._refused = frozenset(refused)
        else:
            roots = await asyncio.to_thread(resolve_roots, sources)
        if sources != self.sources:  # the list changed while resolving: the next round applies it
            return
        if not roots and self.endpoints and not self._refused:
            logger.warning("backend %s: no endpoint resolves now; keeping the last addresses", self.model_id)
            return
        self.set_endpoints(roots, self.endpoint_concurrency)

    async def probe(self, client: httpx.AsyncClient, endpoint: Endpoint) -> bool:
        """One active health check; a 200 admits ``endpoint`` again."""
        headers = {"Host": endpoint.host} if endpoint.host else None
        # a pinned https endpoint: the certificate is checked against the host name, not the address
        tls = (
            {"sni_hostname": urlsplit(f"//{endpoint.host}").hostname}
            if endpoint.host and endpoint.root.startswith("https:")
            else None
        )
        try:
            response = await client.get(
                f"{endpoint.root}{self.health_path}", timeout=2.0, headers=headers, extensions=tls
            )
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
        hits = CounterMetricFamily(
            "tierline_backend_affinity_hits",
            "Requests its prefix affinity sent to their preferred endpoint",
            labels=labels,
        )
        draining = GaugeMetricFamily("tierline_backend_endpoint_draining", "1: left the list, draining", labels=labels)
        misses = CounterMetricFamily(
            "tierline_backend_affinity_misses",
            "Requests with an affinity key sent elsewhere (their preferred endpoint was loaded)",
            labels=["model"],
        )
        for pool in list(self.pools):
            waiting.add_metric([pool.model_id], pool.waiting)
            for e in list(pool.endpoints):
                key = [pool.model_id, e.root]
                outstanding.add_metric(key, e.outstanding)
                up.add_metric(key, 1.0 if e.admitted else 0.0)
                requests.add_metric(key, e.requests)
                failures.add_metric(key, e.failures)
                ejections.add_metric(key, e.ejections)
                hits.add_metric(key, e.affinity_hits)
                draining.add_metric(key, 1.0 if e.draining else 0.0)
            misses.add_metric([pool.model_id], pool.affinity_misses)
        yield from (outstanding, up, requests, failures, ejections, waiting, hits, draining, misses)
