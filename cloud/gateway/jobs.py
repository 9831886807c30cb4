"""Async jobs: the settings, the job's JSON, and the job records (``JobStore``).

A job is an inference request accepted with ``"async": true`` (or ``Prefer: respond-async``): stored as
``queued``, taken by a worker (``running``), and finished as ``succeeded`` with the JSON the synchronous
call would have returned, or ``failed`` with an OpenAI-shaped error. Workers claim a job with one
conditional UPDATE, so two replicas never run it at once, and hold it under a lease they renew; a worker
that dies lets its lease lapse and the job is taken again. The attempt number fences a finish: a worker
whose lease was taken over cannot overwrite the newer attempt's outcome.

Idle workers are woken rather than polling: by the process that queued a job, on PostgreSQL by a ``NOTIFY`` on
``JOBS_CHANNEL`` that every replica ``LISTEN``s to (``listen_for_jobs``; a job queued on one replica whose
workers are busy is taken by another at once), and when the earliest job known to the store falls due (a
retry's delay, a lapsed lease). ``job_poll_s`` only bounds how long an idle process goes without looking.

A job's usage record has the job's id, so a re-run is billed once. A job cut off by a crash is billed only by
its re-run; one still running when a graceful stop's drain time ends is billed for what that attempt
generated (the usage record of an abandoned request), and its re-run's record is then a duplicate.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

import psycopg
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict
from sqlalchemy import func, text, update
from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError
from sqlmodel import Session, col, select

from controlplane.storage.tables import Job, WebhookDelivery, utcnow
from controlplane.storage.types import as_utc
from shared.errors import NotFoundError

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
INFERENCE = "/v1/inference"
ENDPOINTS = (CHAT, COMPLETIONS, INFERENCE)

logger = logging.getLogger(__name__)

QUEUED, RUNNING, SUCCEEDED, FAILED = "queued", "running", "succeeded", "failed"
MAX_LIST_LIMIT = 100
JOBS_CHANNEL = "tierline_jobs"  # PostgreSQL: notified when a job is queued or given back, to every replica
LISTEN_RETRY_S = 5.0  # a lost listening connection is opened again after this
MIN_POLL_S = 0.25  # an idle process's shortest wait, however soon the next job or delivery falls due
DUE_SLACK_S = 0.01  # looked for this long after a due time, so that what fell due is due when looked for


class JobSettings(BaseSettings):
    """Async jobs and webhooks on the cloud (env prefix ``TIERLINE_CLOUD_``)."""

    model_config = SettingsConfigDict(env_prefix="TIERLINE_CLOUD_", extra="ignore")

    job_workers: int = Field(4, ge=1, le=256, description="jobs run at once by each cloud process")
    job_poll_s: float = Field(
        15.0,
        gt=0,
        description="the longest an idle process goes without looking for jobs and webhook deliveries it was not "
        "told of (a crashed replica's leftovers); new jobs, due retries and lapsed leases wake it sooner",
    )
    job_lease_s: float = Field(60.0, gt=0, description="a running job whose worker went silent is retaken after this")
    job_max_attempts: int = Field(5, ge=1, description="runs of one job (restarts, retried overloads) before it fails")
    job_drain_s: float = Field(30.0, ge=0, description="on shutdown, how long running jobs may finish before release")
    webhook_max_attempts: int = Field(5, ge=1, description="POSTs of one webhook delivery before it is given up")
    webhook_base_delay_s: float = Field(5.0, gt=0, description="first retry delay; doubles each attempt, with jitter")
    webhook_timeout_s: float = Field(10.0, gt=0, description="how long a receiver may take to answer")
    webhook_allow_private_networks: bool = Field(
        False, description="allow webhooks to loopback/private/link-local addresses (tests, on-prem receivers)"
    )


def _unix(ts: datetime | None) -> int | None:
    return int(ts.timestamp()) if ts is not None else None


def job_json(job: Job) -> dict[str, Any]:
    """The job as the API shows it (and as webhooks carry it). Times are Unix seconds, as in OpenAI objects."""
    return {
        "id": job.id,
        "object": "job",
        "endpoint": job.endpoint,
        "model": job.model,
        "status": job.status,
        "created_at": _unix(job.created_at),
        "started_at": _unix(job.started_at),
        "finished_at": _unix(job.finished_at),
        "attempts": job.attempts,
        "webhook_url": job.webhook_url,
        "result": job.result,
        "error": job.error,
    }


class JobStore:
    """Job records. Synchronous (SQL); the async callers run it in a thread."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def create(self, job: Job) -> tuple[Job, bool]:
        """Insert ``job``; when its id exists (an ``Idempotency-Key`` retry) return the stored one instead."""
        with Session(self.engine, expire_on_commit=False) as session:
            session.add(job)
            self._notify(session)
            try:
                session.commit()
                return job, True
            except IntegrityError:
                session.rollback()
        with Session(self.engine) as session:
            stored = session.get(Job, job.id)
            if stored is None or stored.tenant_id != job.tenant_id:  # deleted meanwhile; not expected
                raise NotFoundError(f"no job '{job.id}'", param="id")
            session.expunge(stored)
            return stored, False

    def get(self, tenant_id: int, job_id: str) -> Job:
        """The tenant's job; another tenant's job is as unknown as a made-up id."""
        with Session(self.engine) as session:
            job = session.get(Job, job_id)
            if job is None or job.tenant_id != tenant_id:
                raise NotFoundError(f"no job '{job_id}'", param="id", code="job_not_found")
            session.expunge(job)
            return job

    def recent(self, tenant_id: int, limit: int) -> list[Job]:
        with Session(self.engine) as session:
            stmt = (
                select(Job)
                .where(Job.tenant_id == tenant_id)
                .order_by(col(Job.created_at).desc(), col(Job.id).desc())
                .limit(limit)
            )
            jobs = list(session.exec(stmt))
            session.expunge_all()
            return jobs

    def _notify(self, session: Session) -> None:
        """Tell every replica's idle workers (on PostgreSQL: delivered when the transaction commits, not at all
        when it rolls back)."""
        if self.engine.dialect.name == "postgresql":
            session.execute(text("SELECT pg_notify(:channel, '')"), {"channel": JOBS_CHANNEL})

    def next_due(self) -> datetime | None:
        """When the earliest job not finished falls due (queued: its retry delay; running: its lease's end)."""
        with Session(self.engine) as session:
            due = session.exec(select(func.min(Job.available_at)).where(col(Job.status).in_((QUEUED, RUNNING)))).one()
            return as_utc(due) if due is not None else None

    def claim(self, lease_s: float, max_candidates: int = 8) -> Job | None:
        """Take the oldest job that is due (queued, or running under a lapsed lease); None when there is none."""
        now = utcnow()
        with Session(self.engine) as session:
            due = (
                select(Job.id, Job.attempts)
                .where(col(Job.status).in_((QUEUED, RUNNING)), col(Job.available_at) <= now)
                .order_by(col(Job.created_at))
                .limit(max_candidates)
            )
            for job_id, attempts in session.exec(due).all():
                taken = session.exec(
                    update(Job)
                    .where(
                        col(Job.id) == job_id,
                        col(Job.attempts) == attempts,
                        col(Job.status).in_((QUEUED, RUNNING)),
                        col(Job.available_at) <= now,
                    )
                    .values(
                        status=RUNNING,
                        attempts=attempts + 1,
                        started_at=now,
                        available_at=now + timedelta(seconds=lease_s),
                    )
                )
                session.commit()
                if taken.rowcount == 1:
                    job = session.get(Job, job_id)
                    if job is not None:
                        session.expunge(job)
                        return job
        return None

    def renew(self, claims: list[tuple[str, int]], lease_s: float) -> None:
        """Extend the leases of jobs this worker is running (``(id, attempt)`` pairs)."""
        if not claims:
            return
        until = utcnow() + timedelta(seconds=lease_s)
        with Session(self.engine) as session:
            for job_id, attempt in claims:
                session.exec(
                    update(Job)
                    .where(col(Job.id) == job_id, col(Job.attempts) == attempt, col(Job.status) == RUNNING)
                    .values(available_at=until)
                )
            session.commit()

    def requeue(self, job_id: str, attempt: int, delay_s: float = 0.0) -> bool:
        """Give the job back (shutdown, or a transient error to retry after ``delay_s``)."""
        with Session(self.engine) as session:
            done = session.exec(
                update(Job)
                .where(col(Job.id) == job_id, col(Job.attempts) == attempt, col(Job.status) == RUNNING)
                .values(status=QUEUED, available_at=utcnow() + timedelta(seconds=delay_s))
            )
            if delay_s <= 0:
                self._notify(session)  # given back (a stopping replica): another takes it now
            session.commit()
            return done.rowcount == 1

    def finish(
        self,
        job_id: str,
        attempt: int,
        *,
        result: dict[str, Any] | None = None,
        error: dict[str, Any] | None = None,
        delivery_id: str | None = None,
    ) -> bool:
        """Record the outcome of attempt ``attempt``, and queue its webhook delivery in the same transaction.

        False when the attempt no longer holds the job (its lease lapsed and another attempt took over).
        """
        now = utcnow()
        outcome: dict[str, Any] = {"error": error} if error is not None else {"result": result}
        with Session(self.engine) as session:
            done = session.exec(
                update(Job)
                .where(col(Job.id) == job_id, col(Job.attempts) == attempt, col(Job.status) == RUNNING)
                .values(status=FAILED if error is not None else SUCCEEDED, finished_at=now, **outcome)
            )
            if done.rowcount != 1:
                session.rollback()
                return False
            job = session.get(Job, job_id)
            if delivery_id is not None and job is not None and job.webhook_url:
                session.add(
                    WebhookDelivery(
                        id=delivery_id, job_id=job_id, tenant_id=job.tenant_id, url=job.webhook_url, available_at=now
                    )
                )
            session.commit()
            return True


async def seconds_until_due(next_due: Callable[[], datetime | None], poll_s: float, what: str) -> float:
    """How long an idle process waits before looking again: until the earliest due time ``next_due`` (run in a
    thread) reads from the store, within ``MIN_POLL_S``..``poll_s`` (``poll_s`` when there is none)."""
    try:
        due = await asyncio.to_thread(next_due)
    except Exception:
        logger.exception("looking for the next due %s failed", what)
        return poll_s
    if due is None:
        return poll_s
    return min(poll_s, max(MIN_POLL_S, (due - utcnow()).total_seconds() + DUE_SLACK_S))


async def _notified(connection: psycopg.AsyncConnection[Any], wake: Callable[[], None]) -> None:
    """Call ``wake`` for each notification ``connection`` receives, until it is lost (``psycopg.OperationalError``).

    Waits on the socket alone: psycopg's ``notifies()`` wakes every 0.1 s to look for interrupts, re-registering
    the socket each time: ten turns of the event loop a second, all day, on a gateway with nothing to do.
    """
    pgconn = connection.pgconn
    loop = asyncio.get_running_loop()
    readable = asyncio.Event()
    socket = pgconn.socket
    loop.add_reader(socket, readable.set)
    try:
        while True:
            await readable.wait()
            readable.clear()
            pgconn.consume_input()  # raises OperationalError once the server or the network dropped it
            while pgconn.notifies() is not None:
                wake()
            if pgconn.status != psycopg.pq.ConnStatus.OK:
                raise psycopg.OperationalError("the connection listening for jobs was lost")
    finally:
        loop.remove_reader(socket)


async def listen_for_jobs(conninfo: str, wake: Callable[[], None]) -> None:
    """Call ``wake`` for each ``NOTIFY`` on ``JOBS_CHANNEL`` (a job queued or given back by any replica), and
    once on each (re)connection: what was queued while not listening is looked for then. Runs until cancelled;
    a lost connection is opened again after ``LISTEN_RETRY_S`` (the poll covers the gap)."""
    while True:
        try:
            connection = await psycopg.AsyncConnection.connect(conninfo, autocommit=True)
            async with connection:
                await connection.execute(f"LISTEN {JOBS_CHANNEL}")
                wake()
                await _notified(connection, wake)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            logger.warning("listening for queued jobs failed (%s); trying again in %gs", exc, LISTEN_RETRY_S)
        await asyncio.sleep(LISTEN_RETRY_S)
