"""Usage metering off the hot path: one record per request, handed to the ledger in batches by a background task."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Callable
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError
from sqlmodel import Session

from cloud.gateway.pg_async import AsyncPostgres
from controlplane.billing import hotpath
from controlplane.billing.budgets import DEFAULT_LEASE_S, BudgetHold, reserve_request
from controlplane.billing.ledger import NewUsage, checkpoint, ingest_usage, settle_checkpointed
from controlplane.billing.scopes import Attribution

logger = logging.getLogger(__name__)

# What ``submit`` takes as keywords: a usage record's columns (the ledger's fields, plus its rating).
_COLUMNS = frozenset(f.name for f in dataclasses.fields(NewUsage)) - {"id", "tenant_id", "model", "tier", "rating"}
_COLUMNS_WITH_RATING = _COLUMNS | {"price_id", "cost"}


class UsageWriter:
    """Collects usage records and hands them to the ledger in batches every ``flush_interval_s`` (or when a
    batch fills).

    A record arrives rated: the request's budget hold settled at the cost the price book gave it, so the ledger
    stores that price and cost (and counts no spend: the hold did). The request's path builds no ORM object
    (~80 µs each on the event loop); the writer's thread inserts a batch with one statement. Insertion is
    idempotent by record id (``controlplane.billing.ledger.ingest_usage``): a retried id is skipped
    (``num_duplicates``), and one whose stored record differs is also counted in ``num_conflicts`` (and logged
    by the ledger).
    ``close()`` writes everything still queued (graceful shutdown loses nothing).

    A request's billing phases (``reserve_request``, ``checkpoint``, ``settle_checkpointed``) are awaited by the
    request itself; a stream's reservation also writes its first checkpoint (``reserve_and_open``). On PostgreSQL
    each is one statement (``controlplane.billing.hotpath``) awaited on the event loop through a pool of at most
    ``pool_size`` connections of its own (``cloud.gateway.pg_async``); a phase the fast statement does not cover
    runs the general path in a worker thread, as SQLite always does.
    """

    def __init__(
        self,
        engine: Engine,
        flush_interval_s: float = 0.2,
        max_batch: int = 512,
        checkpoint_tokens: int = 0,
        checkpoint_ms: float = 0.0,
        pool_size: int = 10,
        durable: bool = True,
    ) -> None:
        self.engine = engine
        self.postgres = AsyncPostgres(engine, pool_size) if engine.dialect.name == "postgresql" else None
        self.checkpoint_tokens = checkpoint_tokens
        self.checkpoint_ms = checkpoint_ms
        self.flush_interval_s = flush_interval_s
        self.max_batch = max_batch
        self._queue: asyncio.Queue[NewUsage] = asyncio.Queue()
        self._queued = asyncio.Event()  # set by enqueue: an idle writer sleeps until there is something to write
        self._urgent = asyncio.Event()  # set by write_through: someone awaits the commit, flush without waiting
        self._waiting: dict[str, asyncio.Future[None]] = {}  # record id -> the write_through awaiting its commit
        self.durable_timeout_s = 2.0  # write_through gives up waiting (the record stays queued) after this
        self.durable = durable  # store() commits a finished request's record before its answer goes out
        self._task: asyncio.Task[None] | None = None
        self.num_written = 0
        self.num_duplicates = 0
        self.num_conflicts = 0
        self.num_refused = 0
        self.num_checkpoints = 0
        self.num_fast = 0  # billing phases done in one statement on the event loop (PostgreSQL)
        self.on_conflicts: Callable[[int], None] | None = None  # told how many records of a batch conflicted

    @staticmethod
    def record(id: str, tenant_id: int, model: str, tier: str, **columns: Any) -> NewUsage:
        """A record: ``usage_record``'s columns, ``price_id`` and ``cost`` its rating (None: unpriced),
        ``occurred_at`` now unless given."""
        unknown = columns.keys() - _COLUMNS_WITH_RATING
        if unknown:
            raise TypeError(f"usage_record has no column {', '.join(sorted(unknown))}")
        rating = (columns.pop("price_id", None), columns.pop("cost", None))
        columns.setdefault("occurred_at", datetime.now(UTC))
        return NewUsage(id=id, tenant_id=tenant_id, model=model, tier=tier, rating=rating, **columns)

    def submit(self, id: str, tenant_id: int, model: str, tier: str, **columns: Any) -> None:
        """Queue one record (``record``'s arguments)."""
        self.enqueue(self.record(id, tenant_id, model, tier, **columns))

    def enqueue(self, usage: NewUsage) -> None:
        self._queue.put_nowait(usage)
        self._queued.set()

    async def store(self, usage: NewUsage) -> None:
        """A finished request's record: committed before the caller answers (``write_through``) when
        ``durable``, else queued (a ``kill -9`` within ``flush_interval_s`` would lose it)."""
        if self.durable:
            await self.write_through(usage)
        else:
            self.enqueue(usage)

    async def write_through(self, usage: NewUsage) -> bool:
        """Queue ``usage`` and return once it is committed (True), so a response sent after it is never without
        its record, even if the process is killed the next moment. Records awaited together share one commit (the
        writer flushes at once, taking every record queued by then). If the commit does not come within
        ``durable_timeout_s`` (database down), False: the record stays queued and is retried, and the answer goes
        out anyway (availability over billing, as for stream checkpoints)."""
        done = asyncio.get_running_loop().create_future()
        self._waiting[usage.id] = done
        self.enqueue(usage)
        self._urgent.set()
        try:
            await asyncio.wait_for(asyncio.shield(done), self.durable_timeout_s)
            return True
        except TimeoutError:
            logger.warning(
                "usage record %s not yet written after %.1fs; it stays queued", usage.id, self.durable_timeout_s
            )
            return False
        finally:
            self._waiting.pop(usage.id, None)

    # -- streamed requests: their usage so far is durable before their tokens are sent -------------------------
    @property
    def checkpoints(self) -> bool:
        return self.checkpoint_tokens > 0

    def is_checkpoint_due(self, new_tokens: int, since_s: float) -> bool:
        """Whether a stream that generated ``new_tokens`` since its last checkpoint, ``since_s`` seconds ago, must
        write one before it sends them (always before its first bytes: ``since_s`` is inf then)."""
        if not self.checkpoints:
            return False
        return (
            since_s == float("inf")
            or new_tokens >= self.checkpoint_tokens
            or (new_tokens > 0 and self.checkpoint_ms > 0 and since_s * 1000 >= self.checkpoint_ms)
        )

    # -- a request's budget hold, checkpoints and settlement, awaited by the request -----------------------------
    async def reserve_request(
        self,
        tenant_id: int,
        budget: Decimal | None,
        amount: Decimal,
        who: Attribution,
        lease_s: float = DEFAULT_LEASE_S,
    ) -> BudgetHold | None:
        """``controlplane.billing.budgets.reserve_request``: one statement on PostgreSQL when only the tenant's
        monthly budget applies and covers ``amount``; the general path otherwise (and for its precise refusal)."""
        if self.postgres is not None:
            prepared = hotpath.reservation(tenant_id, budget, amount, who, lease_s=lease_s)
            async with self.postgres.connection() as connection:
                held = await hotpath.reserve_async(connection, prepared)
            if held is not hotpath.FALLBACK:
                self.num_fast += 1
                return held
        return await asyncio.to_thread(reserve_request, self.engine, tenant_id, budget, amount, who, lease_s=lease_s)

    async def reserve_and_open(
        self,
        tenant_id: int,
        budget: Decimal | None,
        amount: Decimal,
        who: Attribution,
        opening: NewUsage,
        lease_s: float = DEFAULT_LEASE_S,
    ) -> tuple[BudgetHold | None, bool]:
        """``reserve_request`` for a stream, whose first checkpoint (``opening``: its prompt, no completion yet) is
        written with the hold: by the same statement on PostgreSQL's fast path, in the same worker-thread call
        otherwise. Also whether that checkpoint was written (if not, the stream writes its first before its first
        bytes, as without one)."""
        if self.postgres is not None:
            prepared = hotpath.reservation(tenant_id, budget, amount, who, lease_s=lease_s, opening=opening)
            async with self.postgres.connection() as connection:
                held, opened = await hotpath.reserve_and_open_async(connection, prepared)
            if held is not hotpath.FALLBACK:
                self.num_fast += 1
                self.num_checkpoints += opened
                return held, opened

        def reserve_then_open() -> tuple[BudgetHold | None, bool]:
            hold = reserve_request(self.engine, tenant_id, budget, amount, who, lease_s=lease_s)
            try:
                self._checkpoint(opening, hold, lease_s)
            except Exception:  # the hold stands: the stream writes its first checkpoint before its first bytes
                logger.exception("writing the opening checkpoint of request %s failed", opening.id)
                return hold, False
            return hold, True

        return await asyncio.to_thread(reserve_then_open)

    async def checkpoint(self, usage: NewUsage, hold: BudgetHold | None, lease_s: float) -> None:
        """Write a stream's counts so far (``controlplane.billing.ledger.checkpoint``), committed on return."""
        if self.postgres is not None:
            async with self.postgres.connection() as connection:
                await hotpath.checkpoint_async(connection, usage, hold, lease_s)
            self.num_checkpoints += 1
            self.num_fast += 1
            return
        await asyncio.to_thread(self._checkpoint, usage, hold, lease_s)

    def _checkpoint(self, usage: NewUsage, hold: BudgetHold | None, lease_s: float) -> None:
        with Session(self.engine) as session:
            checkpoint(session, usage, hold, lease_s)
            session.commit()
        self.num_checkpoints += 1

    async def settle_checkpointed(
        self, usage: NewUsage, hold: BudgetHold | None, *, checkpointed: bool = True
    ) -> Decimal | None:
        """A checkpointed stream's final record, hold and checkpoint (``checkpointed``: it wrote one), in one
        transaction (not queued): one statement on PostgreSQL for a hold on the month alone
        (``controlplane.billing.hotpath.settle_async``)."""
        if self.postgres is not None and hotpath.settles_fast(usage, hold):
            async with self.postgres.connection() as connection:
                settled = await hotpath.settle_async(connection, usage, hold, checkpointed)
            self.num_fast += 1
            if settled.inserted:
                self.num_written += 1
            elif settled.conflict:
                self.num_duplicates += 1
                self.num_conflicts += 1
                if self.on_conflicts is not None:
                    self.on_conflicts(1)
            elif settled.duplicate:
                self.num_duplicates += 1
            return settled.spent
        return await asyncio.to_thread(self._settle_checkpointed, usage, hold, checkpointed)

    def _settle_checkpointed(self, usage: NewUsage, hold: BudgetHold | None, checkpointed: bool) -> Decimal | None:
        with Session(self.engine) as session:
            spent = settle_checkpointed(session, usage, hold, checkpointed=checkpointed)
            session.commit()
        self.num_written += 1
        return spent

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="usage-writer")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        await self._flush()
        if self.postgres is not None:
            await self.postgres.close()

    async def flush(self) -> None:
        """Write what is queued now (tests and shutdown)."""
        await self._flush()

    async def _run(self) -> None:
        while True:
            if self._queue.empty():  # nothing to write: no wake-up every interval while idle
                self._queued.clear()
                await self._queued.wait()
            if not self._urgent.is_set():  # the interval's records, in one batch, unless someone awaits a commit
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._urgent.wait(), self.flush_interval_s)
            self._urgent.clear()
            try:
                await self._flush()
            except Exception:
                logger.exception("writing usage records failed; they stay queued and are retried")

    async def _flush(self) -> None:
        while not self._queue.empty():
            batch: list[NewUsage] = []
            while not self._queue.empty() and len(batch) < self.max_batch:
                batch.append(self._queue.get_nowait())
            try:
                await asyncio.to_thread(self._write, batch)
            except Exception:
                for record in batch:
                    self._queue.put_nowait(record)
                raise
            for record in batch:  # committed (or refused and logged): whoever awaits it may answer now
                waiter = self._waiting.get(record.id)
                if waiter is not None and not waiter.done():
                    waiter.set_result(None)

    def _write(self, batch: list[NewUsage]) -> None:
        try:
            self._ingest(batch)
            return
        except IntegrityError:
            pass
        # A record the database refuses (its tenant or key deleted meanwhile) must not hold the batch back forever.
        for record in batch:
            try:
                self._ingest([record])
            except IntegrityError as exc:
                self.num_refused += 1
                logger.error("usage record %s was refused and dropped: %s", record.id, exc.orig)

    def _ingest(self, batch: list[NewUsage]) -> None:
        with Session(self.engine) as session:
            result = ingest_usage(session, batch, count_spend=False)
            session.commit()
        self.num_written += result.accepted
        # A retry of the cloud's own id is skipped whatever it carries; the conflicting ones are also counted apart.
        self.num_duplicates += result.duplicates + result.conflicts
        self.num_conflicts += result.conflicts
        if result.conflicts and self.on_conflicts is not None:
            self.on_conflicts(result.conflicts)
