"""Sends webhook deliveries: a background task in the cloud process takes due deliveries from the database
(so deliveries pending at a restart resume, and replicas share the work) and POSTs them, a bounded number at
a time."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from urllib.parse import urlsplit

import httpx

from cloud.jobs import JobSettings, job_json
from cloud.webhooks import (
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
        self._client = httpx.AsyncClient(timeout=self.timeout_s, follow_redirects=False)
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
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.poll_s)
            self._wake.clear()

    def _done(self, task: asyncio.Task[None]) -> None:
        self._inflight.discard(task)
        self._wake.set()
        if not task.cancelled() and task.exception() is not None:
            logger.error("webhook attempt crashed", exc_info=task.exception())

    async def _refusal(self, url: str) -> str | None:
        """Why ``url`` may not be called: its host resolves to a non-public address (unless allowed)."""
        if self.allow_private:
            return None
        parts = urlsplit(url)
        host = parts.hostname or ""
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(host, parts.port or 443)
        except OSError as exc:
            return f"cannot resolve {host}: {exc}"
        if any(not is_public_address(str(info[4][0])) for info in infos):
            return f"refused: {host} resolves to a non-public address"
        return None

    async def _attempt(self, claimed: ClaimedDelivery) -> None:
        body = webhook_body(claimed)
        status_code: int | None = None
        error: str | None = None
        is_final = claimed.attempt >= self.max_attempts
        started = time.monotonic()
        if claimed.secret is None:
            error, is_final = "the tenant has no webhook secret", True
        elif (refusal := await self._refusal(claimed.url)) is not None:
            error, is_final = refusal, True
        else:
            headers = {
                "content-type": "application/json",
                "user-agent": "tierline-webhooks/1",
                SIGNATURE_HEADER: sign(claimed.secret, body),
                DELIVERY_HEADER: claimed.id,
                EVENT_HEADER: claimed.event,
                TIMESTAMP_HEADER: str(int(time.time())),
            }
            try:
                async with self._client.stream("POST", claimed.url, content=body, headers=headers) as response:
                    status_code = response.status_code  # the receiver's body is not read
            except httpx.TimeoutException:
                error = f"no answer within {self.timeout_s:g}s"
            except httpx.HTTPError as exc:
                error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
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
