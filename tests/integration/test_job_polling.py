"""Idle job workers poll the shared job store once per ``job_poll_s`` per process, not once per worker."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any, cast

from sqlalchemy import create_engine

from cloud.job_worker import JobWorker
from cloud.jobs import JobSettings, JobStore
from controlplane.storage.tables import Job
from tests.conftest import migrated_sqlite


class CountingStore(JobStore):
    """The real store (SQLite), counting its polls."""

    claims = 0

    def claim(self, lease_s: float, max_candidates: int = 8) -> Job | None:
        self.claims += 1
        return super().claim(lease_s, max_candidates)


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


def test_a_notify_wakes_every_idle_worker(tmp_path: Path) -> None:
    # A long poll interval: only the first looks and the three notifies make claims (8 workers each).
    claims = _polls(tmp_path, workers=8, poll_s=60.0, seconds=0.6, notifies=3)
    assert claims == 8 + 3 * 8, claims
