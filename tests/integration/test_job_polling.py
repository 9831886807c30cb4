"""Idle job workers poll the shared job store once per ``job_poll_s`` per process, not once per worker; a
notify wakes one of them; a job that falls due later (a retry's delay, a lapsed lease) is taken then, not at
the next poll; on PostgreSQL, a job queued by another replica wakes this one's workers at once."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, cast

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import Engine
from sqlmodel import Session

from cloud.gateway.job_worker import JobWorker
from cloud.gateway.jobs import CHAT, JOBS_CHANNEL, LISTEN_RETRY_S, JobSettings, JobStore
from controlplane.storage.migrate import upgrade
from controlplane.storage.tables import Job, Tenant, utcnow
from tests.conftest import PG_URL, _postgres_schema, migrated_sqlite


class CountingStore(JobStore):
    """The real store, counting its polls and noting when each job was taken."""

    def __init__(self, engine: Engine) -> None:
        super().__init__(engine)
        self.claims = 0
        self.taken: dict[str, float] = {}

    def claim(self, lease_s: float, max_candidates: int = 8) -> Job | None:
        self.claims += 1
        job = super().claim(lease_s, max_candidates)
        if job is not None:
            self.taken[job.id] = time.monotonic()
        return job


def _job(engine: Engine, job_id: str, available_at: datetime) -> Job:
    """A job of a new tenant. Taken, it fails at once: these workers have no executor (nothing is run, billed or
    called back)."""
    with Session(engine) as session:
        tenant = Tenant(name=f"t-{job_id}")
        session.add(tenant)
        session.commit()
        assert tenant.id is not None
        tenant_id = tenant.id
    return Job(id=job_id, tenant_id=tenant_id, endpoint=CHAT, model="m", request={}, available_at=available_at)


def _polls(tmp_path: Path, workers: int, poll_s: float, seconds: float, notifies: int = 0) -> int:
    engine = create_engine(migrated_sqlite(tmp_path))
    store = CountingStore(engine)
    settings = JobSettings(job_workers=workers, job_poll_s=poll_s)
    idle = cast(Any, None)  # no job is ever found: nothing runs, bills or calls back
    worker = JobWorker(store, idle, engine, idle, idle, settings)

    async def main() -> None:
        await worker.start()
        started = time.monotonic()
        for _ in range(notifies):
            await asyncio.sleep(seconds / (notifies + 1))
            worker.notify()
        await asyncio.sleep(seconds - (time.monotonic() - started))
        await worker.stop()

    asyncio.run(main())
    engine.dispose()
    return store.claims


def test_idle_workers_share_one_poll_timer(tmp_path: Path) -> None:
    # 8 workers, 50 ms poll, 1 s: one poller makes about 20 polls (plus each worker's first look); a poll per
    # worker would make about 160.
    claims = _polls(tmp_path, workers=8, poll_s=0.05, seconds=1.0)
    assert 8 + 10 <= claims <= 8 + 30, claims


def test_a_notify_wakes_one_idle_worker(tmp_path: Path) -> None:
    # A long poll interval: each worker's first look, then one claim per notify (not one per idle worker).
    claims = _polls(tmp_path, workers=8, poll_s=60.0, seconds=0.6, notifies=3)
    assert claims == 8 + 3, claims


def test_a_job_that_falls_due_later_is_taken_then_not_at_the_next_poll(tmp_path: Path) -> None:
    engine = create_engine(migrated_sqlite(tmp_path))
    store = CountingStore(engine)
    worker = JobWorker(store, cast(Any, None), engine, cast(Any, None), cast(Any, None), JobSettings(job_poll_s=60))

    async def main() -> float:
        started = time.monotonic()
        store.create(_job(engine, "job-later", utcnow() + timedelta(seconds=0.5)))  # as a retry's delay leaves it
        await worker.start()
        while "job-later" not in store.taken and time.monotonic() - started < 5:
            await asyncio.sleep(0.02)
        await worker.stop()
        return store.taken.get("job-later", float("inf")) - started

    after = asyncio.run(main())
    engine.dispose()
    assert 0.45 <= after < 4.0, after  # when due (a loaded host adds its latency); a poll would come after 60 s
    assert store.claims <= 4 + 3, store.claims  # each worker's first look, then about one when due


@pytest.fixture
def postgres_url() -> Iterator[str]:
    if not PG_URL:
        pytest.skip("PostgreSQL not configured: set TIERLINE_TEST_DATABASE_URL (CI sets it when :5432 answers)")
    with _postgres_schema() as url:
        upgrade(url)
        yield url


@pytest.mark.postgres
def test_a_job_queued_by_another_replica_wakes_this_ones_workers(postgres_url: str) -> None:
    # Two engines: this replica's, and another's that only queues (LISTEN/NOTIFY is PostgreSQL's; on SQLite
    # one process queues and runs its jobs).
    here, there = create_engine(postgres_url), create_engine(postgres_url)
    store = CountingStore(here)
    worker = JobWorker(store, cast(Any, None), here, cast(Any, None), cast(Any, None), JobSettings(job_poll_s=60))

    async def main() -> float:
        await worker.start()
        await asyncio.sleep(1.0)  # its workers idle, listening
        looks = store.claims
        queued = time.monotonic()
        await asyncio.to_thread(JobStore(there).create, _job(there, "job-elsewhere", utcnow()))
        while "job-elsewhere" not in store.taken and time.monotonic() - queued < 5:
            await asyncio.sleep(0.02)
        await worker.stop()
        assert store.claims - looks <= 3, (looks, store.claims)  # one woken worker, not all four
        return store.taken.get("job-elsewhere", float("inf")) - queued

    after = asyncio.run(main())
    here.dispose()
    there.dispose()
    assert after < 1.0, after  # the poll would have come after 60 s


@pytest.mark.postgres
def test_a_lost_listening_connection_is_opened_again_and_looked_after(postgres_url: str) -> None:
    here, there = create_engine(postgres_url), create_engine(postgres_url)
    store = CountingStore(here)
    worker = JobWorker(store, cast(Any, None), here, cast(Any, None), cast(Any, None), JobSettings(job_poll_s=60))
    listening = f"SELECT pid FROM pg_stat_activity WHERE query = 'LISTEN {JOBS_CHANNEL}' AND pid <> pg_backend_pid()"

    def terminate_listeners() -> int:
        with there.begin() as connection:
            pids = [row[0] for row in connection.execute(text(listening))]
            for pid in pids:
                connection.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
        return len(pids)

    async def main() -> tuple[int, float, float]:
        await worker.start()
        await asyncio.sleep(1.0)
        killed = await asyncio.to_thread(terminate_listeners)  # as a PostgreSQL restart or a dropped link would
        await asyncio.sleep(0.5)
        # queued while nobody listens: found by the look the listener takes once it is connected again
        await asyncio.to_thread(JobStore(there).create, _job(there, "job-unheard", utcnow()))
        queued = time.monotonic()
        while "job-unheard" not in store.taken and time.monotonic() - queued < 15:
            await asyncio.sleep(0.05)
        unheard = store.taken.get("job-unheard", float("inf")) - queued
        # and the new connection hears the next one at once
        await asyncio.to_thread(JobStore(there).create, _job(there, "job-heard", utcnow()))
        queued = time.monotonic()
        while "job-heard" not in store.taken and time.monotonic() - queued < 5:
            await asyncio.sleep(0.02)
        heard = store.taken.get("job-heard", float("inf")) - queued
        await worker.stop()
        return killed, unheard, heard

    killed, unheard, heard = asyncio.run(main())
    here.dispose()
    there.dispose()
    assert killed >= 1
    assert unheard < LISTEN_RETRY_S + 3, unheard  # the reconnection's look, not the 60 s poll
    assert heard < 1.0, heard
