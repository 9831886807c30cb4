"""Sends webhook deliveries: a background task in the cloud process takes due deliveries from the database
(so deliveries pending at a restart resume, and replicas share the work) and POSTs them, a bounded number at
a time.

Unless private networks are allowed, a receiver's host name is resolved once per attempt, every address it
resolves to must be public, and the POST connects to one of those very addresses (the URL's host sent as
``Host`` and as the TLS server name, which the certificate is checked against): a name that resolves to a
public address for the check and to an internal one for the connection (DNS rebinding) reaches nothing
internal."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import time
from typing import Any

import httpx

from cloud.gateway.jobs import JobSettings, job_json, seconds_until_due
from cloud.gateway.webhooks import (
    DELIVERY_HEADER,
    EVENT_HEADER,
    SIGNATURE_HEADER,
    TIMESTAMP_HEADER,
    ClaimedDelivery,
    WebhookStore,
    is_public_address,
    retry_delay,
    sign,
)

logger = logging.getLogger(__name__)

MAX_CONCURRENT_DELIVERIES = 16
CLAIM_MARGIN_S = 30.0
DEFAULT_PORTS = {"http": 80, "https": 443}


def webhook_body(claimed: ClaimedDelivery) -> bytes:
    """The exact bytes POSTed and signed: the job's JSON (or the tenant event's), compact."""
    body = job_json(claimed.job) if claimed.job is not None else (claimed.payload or {})
    return json.dumps(body, separators=(",", ":"), sort_keys=True).encode()


class WebhookDispatcher:
    def __init__(self, store: WebhookStore, settings: JobSettings) -> None:
        self.store = store
        self.max_attempts = settings.webhook_max_attempts
        self.base_delay_s = settings.webhook_base_delay_s
        self.timeout_s = settings.webhook_timeout_s
        self.poll_s = settings.job_poll_s
        self.allow_private = settings.webhook_allow_private_networks
        # No kept-alive connections: one pinned to an address for one host name must not carry another's POST.
        limits = httpx.Limits(max_connections=100, max_keepalive_connections=20 if self.allow_private else 0)
        self._client = httpx.AsyncClient(timeout=self.timeout_s, follow_redirects=False, limits=limits)
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._inflight: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="webhook-dispatcher")

    def notify(self) -> None:
        """A delivery was queued (or falls due): look now rather than at the next poll."""
        self._wake.set()

    async def close(self) -> None:
        """Stop; attempts cut short are retried (after their claim lapses) by the next process."""
        tasks = [t for t in (self._task, *self._inflight) if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._task = None
        await self._client.aclose()

    async def _run(self) -> None:
        while True:
            free = MAX_CONCURRENT_DELIVERIES - len(self._inflight)
            try:
                if free > 0:
                    for delivery_id, attempts in await asyncio.to_thread(self.store.due, free):
                        hold_s = self.timeout_s + CLAIM_MARGIN_S
                        claimed = await asyncio.to_thread(self.store.claim, delivery_id, attempts, hold_s)
                        if claimed is not None:
                            task = asyncio.create_task(self._attempt(claimed), name=f"webhook-{claimed.id}")
                            self._inflight.add(task)
                            task.add_done_callback(self._done)
            except Exception:
                logger.exception("looking for due webhook deliveries failed; trying again")
            # All slots busy: an attempt that ends wakes it (the due time would only make it look in vain).
            is_full = len(self._inflight) >= MAX_CONCURRENT_DELIVERIES
            # Else until the earliest pending delivery falls due (a retry; another process's claim, which lapses
            # when that process died mid-attempt): deliveries queued here wake it themselves.
            wait_s = self.poll_s
            if not is_full:
                wait_s = await seconds_until_due(self.store.next_due, self.poll_s, "delivery")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), wait_s)
            self._wake.clear()

    def _done(self, task: asyncio.Task[None]) -> None:
        self._inflight.discard(task)
        self._wake.set()
        if not task.cancelled() and task.exception() is not None:
            logger.error("webhook attempt crashed", exc_info=task.exception())

    async def _resolve(self, url: httpx.URL) -> tuple[list[str], str | None]:
        """The addresses ``url``'s host resolves to, all public; or, with none, why it may not be called."""
        host = url.raw_host.decode("ascii")
        port = url.port or DEFAULT_PORTS.get(url.scheme, 443)
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError as exc:
            return [], f"cannot resolve {host}: {exc}"
        addresses = list(dict.fromkeys(str(info[4][0]) for info in infos))
        if not addresses or any(not is_public_address(a) for a in addresses):
            return [], f"refused: {host} resolves to a non-public address"
        return addresses, None

    async def _post(
        self, url: httpx.URL, body: bytes, headers: dict[str, str], extensions: dict[str, Any]
    ) -> tuple[int | None, str | None, bool]:
        """POST once: the receiver's status code, or what went wrong (its body is not read), and whether no
        connection could be made at all."""
        try:
            async with self._client.stream(
                "POST", url, content=body, headers=headers, extensions=extensions
            ) as response:
                return response.status_code, None, False
        except httpx.TimeoutException:
            return None, f"no answer within {self.timeout_s:g}s", False
        except httpx.HTTPError as exc:
            error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            return None, error, isinstance(exc, httpx.ConnectError)

    async def _deliver(self, url: str, body: bytes, headers: dict[str, str]) -> tuple[int | None, str | None, bool]:
        """POST ``body`` to ``url``: (status code, error, whether retrying is pointless)."""
        try:
            target = httpx.URL(url)
        except httpx.InvalidURL as exc:
            return None, f"invalid URL: {exc}", True
        if self.allow_private:
            status_code, error, _ = await self._post(target, body, headers, {})
            return status_code, error, False
        addresses, refusal = await self._resolve(target)
        if refusal is not None:
            return None, refusal, True
        pinned = {**headers, "host": target.netloc.decode("ascii")}
        tls = {"sni_hostname": target.raw_host.decode("ascii")} if target.scheme == "https" else {}
        status_code, error = None, None
        for address in addresses:
            status_code, error, is_unreachable = await self._post(target.copy_with(host=address), body, pinned, tls)
            if not is_unreachable:
                break
        return status_code, error, False

    async def _attempt(self, claimed: ClaimedDelivery) -> None:
        body = webhook_body(claimed)
        status_code: int | None = None
        error: str | None = None
        is_final = claimed.attempt >= self.max_attempts
        started = time.monotonic()
        if claimed.secret is None:
            error, is_final = "the tenant has no webhook secret", True
        else:
            headers = {
                "content-type": "application/json",
                "user-agent": "tierline-webhooks/1",
                SIGNATURE_HEADER: sign(claimed.secret, body),
                DELIVERY_HEADER: claimed.id,
                EVENT_HEADER: claimed.event,
                TIMESTAMP_HEADER: str(int(time.time())),
            }
            status_code, error, is_refused = await self._deliver(claimed.url, body, headers)
            is_final = is_final or is_refused
        duration_ms = round((time.monotonic() - started) * 1000, 2)
        is_ok = status_code is not None and 200 <= status_code < 300
        retry_in_s = None if is_ok or is_final else retry_delay(claimed.attempt, self.base_delay_s)
        await asyncio.to_thread(
            self.store.record,
            claimed,
            status_code=status_code,
            error=error,
            duration_ms=duration_ms,
            retry_in_s=retry_in_s,
        )
        if retry_in_s is not None:
            asyncio.get_running_loop().call_later(retry_in_s, self._wake.set)
        elif not is_ok:
            subject = f"job {claimed.job.id}" if claimed.job is not None else claimed.event
            logger.warning("webhook delivery %s (%s) failed after %d attempts", claimed.id, subject, claimed.attempt)
