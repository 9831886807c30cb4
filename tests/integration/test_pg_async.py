"""The event loop's PostgreSQL pool of the billing hot path (``cloud.pg_async``), on a real PostgreSQL."""

from __future__ import annotations

import asyncio

import psycopg
import pytest
from sqlalchemy import create_engine

from cloud.pg_async import AsyncPostgres
from tests.conftest import PG_URL

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.skipif(not PG_URL, reason="PostgreSQL not configured: set TIERLINE_TEST_DATABASE_URL"),
]


def _pool(size: int) -> AsyncPostgres:
    assert PG_URL
    return AsyncPostgres(create_engine(PG_URL), size=size)


async def _backend_pid(pg: AsyncPostgres, hold_s: float = 0.0) -> int:
    async with pg.connection() as cursor:
        row = await (await cursor.execute("SELECT pg_backend_pid(), pg_sleep(%s)", (hold_s,))).fetchone()
        assert row is not None
        pid = row[0]
        assert isinstance(pid, int)
        return pid


def test_statements_reuse_the_pools_connections_and_never_exceed_its_size() -> None:
    async def main() -> tuple[set[int], list[int]]:
        pg = _pool(2)
        try:
            # 6 statements at once on a pool of 2: two connections, the others wait for one to come back
            pids = await asyncio.gather(*(_backend_pid(pg, 0.05) for _ in range(6)))
            after = [await _backend_pid(pg) for _ in range(3)]
            return set(pids), after
        finally:
            await pg.close()

    concurrent, after = asyncio.run(main())
    assert len(concurrent) == 2
    assert set(after) <= concurrent  # later statements run on the same two server processes


def test_a_failed_statement_keeps_its_connection_and_a_cancelled_one_loses_it() -> None:
    async def main() -> tuple[int, int, int, int]:
        pg = _pool(1)
        try:
            first = await _backend_pid(pg)
            with pytest.raises(psycopg.errors.DivisionByZero):
                async with pg.connection() as cursor:
                    await cursor.execute("SELECT 1 / 0")
            after_error = await _backend_pid(pg)  # a clean error: the connection (and its cursor) still serve
            slow = asyncio.ensure_future(_backend_pid(pg, 5.0))
            await asyncio.sleep(0.3)
            slow.cancel()  # interrupted mid-statement: its state is unknown, so it is closed, not reused
            with pytest.raises(asyncio.CancelledError):
                await slow
            after_cancel = await asyncio.wait_for(_backend_pid(pg), 10)
            return first, after_error, after_cancel, pg._pool().opened
        finally:
            await pg.close()

    first, after_error, after_cancel, opened = asyncio.run(main())
    assert after_error == first
    assert after_cancel != first
    assert opened == 1


def test_a_waiter_cancelled_after_its_wake_up_passes_it_on() -> None:
    async def main() -> bool:
        pg = _pool(1)
        pool = pg._pool()
        try:
            only = await pool.get()
            first, second = asyncio.ensure_future(pool.get()), asyncio.ensure_future(pool.get())
            await asyncio.sleep(0.05)  # both wait: the pool's one connection is taken
            pool.put(only, broken=False)  # wakes the first waiter...
            first.cancel()  # ...cancelled before it ran: the wake-up must reach the second, not be lost
            with pytest.raises(asyncio.CancelledError):
                await first
            got = await asyncio.wait_for(second, 5)
            pool.put(got, broken=False)
            return got is only
        finally:
            await pg.close()

    assert asyncio.run(main())
