"""Usage metering off the hot path: one record per request, written in batches by a background task."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError
from sqlmodel import Session

from shared.storage.models import UsageRecord

logger = logging.getLogger(__name__)


class UsageWriter:
    """Collects usage records and inserts them in batches every ``flush_interval_s`` (or when a batch fills).

    Insertion is idempotent by record id: a batch that hits an existing id is retried row by row and the
    duplicates are skipped. ``close()`` writes everything still queued (graceful shutdown loses nothing).
    """

    def __init__(self, engine: Engine, flush_interval_s: float = 0.2, max_batch: int = 512) -> None:
        self.engine = engine
        self.flush_interval_s = flush_interval_s
        self.max_batch = max_batch
        self._queue: asyncio.Queue[UsageRecord] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None
        self.num_written = 0
        self.num_duplicates = 0

    def submit(self, record: UsageRecord) -> None:
        self._queue.put_nowait(record)

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="usage-writer")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        await self._flush()

    async def flush(self) -> None:
        """Write what is queued now (tests and shutdown)."""
        await self._flush()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.flush_interval_s)
            try:
                await self._flush()
            except Exception:
                logger.exception("writing usage records failed; they stay queued and are retried")

    async def _flush(self) -> None:
        while not self._queue.empty():
            batch: list[UsageRecord] = []
            while not self._queue.empty() and len(batch) < self.max_batch:
                batch.append(self._queue.get_nowait())
            try:
                await asyncio.to_thread(self._write, batch)
            except Exception:
                for record in batch:
                    self._queue.put_nowait(record)
                raise

    def _write(self, batch: list[UsageRecord]) -> None:
        try:
            with Session(self.engine) as session:
                session.add_all([r.model_copy() for r in batch])
                session.commit()
            self.num_written += len(batch)
            return
        except IntegrityError:
            pass
        for record in batch:
            try:
                with Session(self.engine) as session:
                    session.add(record.model_copy())
                    session.commit()
                self.num_written += 1
            except IntegrityError:
                self.num_duplicates += 1
