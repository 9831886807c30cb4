"""Usage metering off the hot path: one record per request, written in batches by a background task."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import insert
from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError

from controlplane.storage.tables import UsageRecord

logger = logging.getLogger(__name__)

_TABLE = UsageRecord.__table__  # type: ignore[attr-defined]
# Every column a row is inserted with (one executemany needs the same keys in every row), with its default.
_DEFAULTS: dict[str, Any] = {
    c.name: None for c in _TABLE.columns if c.name not in ("id", "occurred_at", "ingested_at", "invoice_id")
}
_DEFAULTS.update(prompt_tokens=0, completion_tokens=0, cached_prompt_tokens=0, status="ok")


class UsageWriter:
    """Collects usage records and inserts them in batches every ``flush_interval_s`` (or when a batch fills).

    A record is the ``usage_record`` row's columns, as keywords of ``submit``: the request's path builds no ORM
    object (~80 µs each on the event loop) and the writer's thread inserts with one executemany (the ORM's unit of
    work took twice as long, holding the interpreter lock the event loop needs). Insertion is idempotent by record
    id: a batch that hits an existing id is retried row by row and the duplicates are skipped. ``close()`` writes
    everything still queued (graceful shutdown loses nothing).
    """

    def __init__(self, engine: Engine, flush_interval_s: float = 0.2, max_batch: int = 512) -> None:
        self.engine = engine
        self.flush_interval_s = flush_interval_s
        self.max_batch = max_batch
        self._queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None
        self.num_written = 0
        self.num_duplicates = 0

    def submit(self, id: str, tenant_id: int, model: str, tier: str, **columns: Any) -> None:
        """Queue one record: ``usage_record``'s columns (``occurred_at`` is now unless given)."""
        unknown = columns.keys() - _DEFAULTS.keys() - {"occurred_at"}
        if unknown:
            raise TypeError(f"usage_record has no column {', '.join(sorted(unknown))}")
        row = {**_DEFAULTS, **columns, "id": id, "tenant_id": tenant_id, "model": model, "tier": tier}
        row.setdefault("occurred_at", datetime.now(UTC))
        self._queue.put_nowait(row)

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
            batch: list[dict[str, Any]] = []
            while not self._queue.empty() and len(batch) < self.max_batch:
                batch.append(self._queue.get_nowait())
            try:
                await asyncio.to_thread(self._write, batch)
            except Exception:
                for record in batch:
                    self._queue.put_nowait(record)
                raise

    def _write(self, batch: list[dict[str, Any]]) -> None:
        now = datetime.now(UTC)
        rows = [{**row, "ingested_at": now} for row in batch]
        try:
            with self.engine.begin() as conn:
                conn.execute(insert(_TABLE), rows)
            self.num_written += len(rows)
            return
        except IntegrityError:
            pass
        for row in rows:
            try:
                with self.engine.begin() as conn:
                    conn.execute(insert(_TABLE), row)
                self.num_written += 1
            except IntegrityError:
                self.num_duplicates += 1
