"""The job workers: asyncio tasks in the cloud process that take queued jobs from the database and run them
as their synchronous route would, then queue the webhook.

Jobs outlive the process: a graceful stop lets running jobs finish (up to ``job_drain_s``) and gives back the
rest; after a crash, running jobs are taken again when their lease lapses. A job's usage record carries the
job id, and the job is marked finished only once that record is stored, so a job run twice (its first run
cut off by a crash) is billed once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from pydantic import ValidationError as PydanticValidationError
from sqlalchemy.engine import Engine
from sqlmodel import Session

from cloud.gateway.jobs import (
    CHAT,
    COMPLETIONS,
    INFERENCE,
    JobSettings,
    JobStore,
    listen_for_jobs,
    seconds_until_due,
)
from cloud.gateway.metering import UsageWriter
from cloud.gateway.pg_async import conninfo_of
from cloud.gateway.webhook_dispatcher import WebhookDispatcher
from cloud.gateway.webhooks import WebhookStore, new_delivery_id
from cloud.serving.completions import Caller, CompletionService
from cloud.serving.engine_pool import EngineRestartingError
from cloud.serving.tensor_models import TensorPool, unknown_model
from controlplane.storage.tables import ApiKey, Job, Tenant, UsageRecord
from shared.errors import ApplicationError, PermissionDeniedError, RateLimitError, ValidationError
from shared.openai_schema import ChatCompletionRequest, CompletionRequest, InferenceRequest

logger = logging.getLogger(__name__)

Executor = Callable[[str, Caller, dict[str, Any]], Awaitable[dict[str, Any]]]
METERED_WAIT_S = 5.0
INTERNAL_ERROR = {"message": "internal error", "type": "server_error", "param": None, "code": None}


class JobExecutor:
    """Runs a stored request through the same service calls as its synchronous route."""

    def __init__(self, service: CompletionService, tensors: TensorPool) -> None:
        self.service = service
        self.tensors = tensors

    async def __call__(self, endpoint: str, caller: Caller, request: dict[str, Any]) -> dict[str, Any]:
        result: dict[str, Any] | AsyncIterator[bytes]
        if endpoint == CHAT:
            result = await self.service.chat(caller, ChatCompletionRequest.model_validate(request))
        elif endpoint == COMPLETIONS:
            result = await self.service.completions(caller, CompletionRequest.model_validate(request))
        elif endpoint == INFERENCE:
            data = InferenceRequest.model_validate(request)
            if self.tensors.serves(data.model_id):
                return await self.tensors.inference(caller, data)
            if data.model_id not in self.service.pool.engines:
                raise unknown_model(data.model_id)
            result = await self.service.inference(caller, data)
        else:
            raise ValidationError(f"endpoint: '{endpoint}' does not run as a job", param="endpoint")
        if not isinstance(result, dict):
            raise ValidationError("stream: a job cannot stream", param="stream")
        return result


def load_caller(engine: Engine, job: Job) -> Caller:
    """The job's tenant and key as they are now: a tenant disabled or a key revoked since does not run."""
    with Session(engine) as session:
        tenant = session.get(Tenant, job.tenant_id)
        key = session.get(ApiKey, job.api_key_id) if job.api_key_id is not None else None
        if tenant is None or not tenant.is_active:
            raise PermissionDeniedError("the tenant that submitted this job is disabled")
        if job.api_key_id is not None and (key is None or key.revoked_at is not None):
            raise PermissionDeniedError("the API key that submitted this job was revoked")
        session.expunge_all()
    return Caller(tenant=tenant, key=key, request_id=job.id, is_job=True)


class JobWorker:
    def __init__(
        self,
        store: JobStore,
        execute: Executor,
        engine: Engine,
        usage: UsageWriter,
        dispatcher: WebhookDispatcher,
        settings: JobSettings,
    ) -> None:
        self.store = store
        self.execute = execute
        self.engine = engine
        self.usage = usage
        self.dispatcher = dispatcher
        self.num_workers = settings.job_workers
        self.poll_s = settings.job_poll_s
        self.lease_s = settings.job_lease_s
        self.max_attempts = settings.job_max_attempts
        self.drain_s = settings.job_drain_s
        self._is_stopping = False
        self._loops: list[asyncio.Task[None]] = []
        self._heartbeat: asyncio.Task[None] | None = None
        self._listener: asyncio.Task[None] | None = None
        self._running: dict[str, int] = {}  # job id -> attempt
        # Idle workers: one (the poller) waits until the next job the store knows of falls due, at most
        # ``poll_s``; the others until notified.
        self._poller: asyncio.Future[None] | None = None
        self._sleepers: deque[asyncio.Future[None]] = deque()
        self._missed = False  # a notify found no idle worker: the next worker to go idle looks first

    async def start(self) -> None:
        self._loops = [asyncio.create_task(self._loop(), name=f"job-worker-{i}") for i in range(self.num_workers)]
        self._heartbeat = asyncio.create_task(self._renew_leases(), name="job-leases")
        if self.engine.dialect.name == "postgresql":  # other replicas' queued jobs wake this one's workers
            conninfo = conninfo_of(self.engine)
            self._listener = asyncio.create_task(listen_for_jobs(conninfo, self.notify), name="job-listener")

    def notify(self) -> None:
        """A job may be due (queued here or by another replica, given back, or a retry rescheduled): one idle
        worker looks now. The poller first, which also waits anew for the store's next due time."""
        if self._poller is not None and not self._poller.done():
            self._poller.set_result(None)
            return
        while self._sleepers:
            waiter = self._sleepers.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self._missed = True

    def _wake_all(self) -> None:
        for waiter in (self._poller, *self._sleepers):
            if waiter is not None and not waiter.done():
                waiter.set_result(None)
        self._sleepers.clear()

    async def stop(self) -> None:
        """Take no new jobs; let running ones finish for up to ``drain_s``, then give the rest back."""
        self._is_stopping = True
        self._wake_all()
        if self._listener is not None:
            self._listener.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._listener
        if self._loops:
            _, pending = await asyncio.wait(self._loops, timeout=self.drain_s)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._heartbeat

    async def _loop(self) -> None:
        while not self._is_stopping:
            try:
                job = await asyncio.to_thread(self.store.claim, self.lease_s)
            except Exception:
                logger.exception("claiming a job failed; trying again")
                job = None
            if job is not None:
                self.notify()  # more may be queued: another idle worker looks too
                try:
                    await self._run(job)
                except Exception:
                    logger.exception("job %s: storing its outcome failed; it runs again when its lease lapses", job.id)
                continue
            await self._idle()

    async def _idle(self) -> None:
        """Wait for a ``notify``; the poller (one idle worker at a time) also for the next due time it finds in the
        store, or ``poll_s`` at most: an idle process queries the store about once per ``poll_s``, not per worker."""
        if self._missed or self._is_stopping:
            self._missed = False
            return
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[None] = loop.create_future()
        if self._poller is not None and not self._poller.done():
            self._sleepers.append(waiter)
            try:
                await waiter
            finally:
                with contextlib.suppress(ValueError):
                    self._sleepers.remove(waiter)
            return
        self._poller = waiter
        try:
            # The earliest job the store knows of: a retry's delay, another worker's lease.
            wait_s = await seconds_until_due(self.store.next_due, self.poll_s, "job")
            if not waiter.done():
                timer = loop.call_later(wait_s, _release, waiter)
                try:
                    await waiter
                finally:
                    timer.cancel()
        finally:
            if self._poller is waiter:
                self._poller = None

    async def _renew_leases(self) -> None:
        while True:
            await asyncio.sleep(self.lease_s / 3)
            try:
                await asyncio.to_thread(self.store.renew, list(self._running.items()), self.lease_s)
            except Exception:
                logger.exception("renewing job leases failed")

    async def _run(self, job: Job) -> None:
        self._running[job.id] = job.attempts
        try:
            await self._run_claimed(job)
        except asyncio.CancelledError:
            await asyncio.to_thread(self.store.requeue, job.id, job.attempts)
            raise
        finally:
            self._running.pop(job.id, None)

    async def _run_claimed(self, job: Job) -> None:
        result: dict[str, Any] | None = None
        error: dict[str, Any] | None = None
        if job.attempts > self.max_attempts:
            error = {
                "message": f"the job was interrupted {job.attempts - 1} times and is not run again",
                "type": "server_error",
                "param": None,
                "code": "job_interrupted",
            }
        else:
            try:
                caller = await asyncio.to_thread(load_caller, self.engine, job)
                result = await self.execute(job.endpoint, caller, job.request)
            except (RateLimitError, EngineRestartingError) as exc:  # overloaded, over a rate, restarting: wait
                if job.attempts < self.max_attempts:
                    delay = max(exc.retry_after, 1.0) * 2 ** (job.attempts - 1)
                    await asyncio.to_thread(self.store.requeue, job.id, job.attempts, delay)
                    self.notify()  # the poller waits for the retry's due time
                    return
                error = exc.to_openai()["error"]
            except ApplicationError as exc:
                error = exc.to_openai()["error"]
            except PydanticValidationError as exc:  # a request stored by an older version that no longer parses
                error = ValidationError(f"request: {exc.errors()[0]['msg']}", param="request").to_openai()["error"]
            except Exception:
                logger.exception("job %s failed", job.id)
                error = dict(INTERNAL_ERROR)
        if result is not None and result.get("usage"):
            await self._until_metered(job.id)
        delivery_id = new_delivery_id() if job.webhook_url else None
        is_finished = await asyncio.to_thread(
            self.store.finish, job.id, job.attempts, result=result, error=error, delivery_id=delivery_id
        )
        if not is_finished:
            logger.warning("job %s attempt %d lost its lease; its outcome was dropped", job.id, job.attempts)
        elif delivery_id is not None:
            self.dispatcher.notify()

    async def _until_metered(self, job_id: str) -> None:
        """Wait until the job's usage record is stored, so a finished job is never unbilled after a crash."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + METERED_WAIT_S
        with contextlib.suppress(Exception):  # a failed write stays queued in the writer; the wait below decides
            await self.usage.flush()
        while not await asyncio.to_thread(self._is_metered, job_id):
            if loop.time() > deadline:
                logger.warning("job %s: its usage record is not stored yet; finishing the job anyway", job_id)
                return
            await asyncio.sleep(0.05)

    def _is_metered(self, job_id: str) -> bool:
        with Session(self.engine) as session:
            return session.get(UsageRecord, job_id) is not None


def _release(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


@asynccontextmanager
async def running_jobs(
    jobs: JobStore,
    webhooks: WebhookStore,
    settings: JobSettings,
    db: Engine,
    service: CompletionService,
    tensors: TensorPool,
    usage: UsageWriter,
) -> AsyncIterator[JobWorker]:
    """The job workers and the webhook dispatcher, for the life of the app."""
    dispatcher = WebhookDispatcher(webhooks, settings)
    worker = JobWorker(jobs, JobExecutor(service, tensors), db, usage, dispatcher, settings)
    await dispatcher.start()
    await worker.start()
    try:
        yield worker
    finally:
        await worker.stop()
        await dispatcher.close()
