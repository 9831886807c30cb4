"""The event loop's PostgreSQL pool of the billing hot path (``cloud.gateway.pg_async``), on a real PostgreSQL."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import psycopg
import pytest
from sqlalchemy import create_engine

from cloud.gateway.pg_async import AsyncPostgres
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


def _run(main: Any, loop: str) -> Any:
    """``main()`` on the asyncio loop or on uvloop (the gateway's)."""
    if loop == "uvloop":
        import uvloop

        return uvloop.run(main())
    return asyncio.run(main())


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_connection_the_server_ends_while_idle_is_dropped_and_replaced(loop: str) -> None:
    """Each pooled connection's socket stays watched by the loop between statements: the server's goodbye (a
    terminated backend) arrives while nothing waits, stops the watch, and the next statement on that connection
    fails cleanly and loses it; the one after runs on a new connection."""

    async def main() -> tuple[int, int]:
        pg = _pool(1)
        try:
            first = await _backend_pid(pg)
            assert PG_URL
            with psycopg.connect(PG_URL, autocommit=True) as admin:
                admin.execute("SELECT pg_terminate_backend(%s)", (first,))
            spent = time.process_time()
            await asyncio.sleep(0.5)  # the goodbye and the close arrive, with no statement waiting
            # ... taken in once, not announced by the loop over and over (the watch is level-triggered)
            assert time.process_time() - spent < 0.2
            with pytest.raises(psycopg.OperationalError):
                await _backend_pid(pg)
            return first, await asyncio.wait_for(_backend_pid(pg), 10)
        finally:
            await pg.close()

    first, replaced = _run(main, loop)
    assert replaced != first


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_statement_larger_than_the_sockets_buffer_is_sent_whole(loop: str) -> None:
    """A statement the socket cannot take at once waits for it to drain (the watched connection's write path: 64
    MiB take several waits for the socket to be writable again here; 8 MiB went in at once)."""

    async def main() -> list[int]:
        pg = _pool(1)
        try:
            sizes: list[int] = []
            for size in (64 << 20, 10):  # 64 MiB, then a small one on the same connection
                async with pg.connection() as cursor:
                    statement = cursor.execute("SELECT length(%s)", ("x" * size,))
                    row = await (await asyncio.wait_for(statement, 60)).fetchone()
                    assert row is not None
                    assert isinstance(row[0], int)
                    sizes.append(row[0])
            return sizes
        finally:
            await pg.close()

    assert _run(main, loop) == [64 << 20, 10]


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_connection_the_server_ends_mid_statement_fails_it_and_is_no_longer_watched(loop: str) -> None:
    """libpq closes the socket of a connection it finds dropped: the pool's watch on that socket number ends with
    the failed statement (a number the system may give the next socket it opens)."""

    async def main() -> tuple[int, int]:
        pg = _pool(1)
        try:
            async with pg.connection() as cursor:
                connection = cursor.connection
            first = await _backend_pid(pg)
            slow = asyncio.ensure_future(_backend_pid(pg, 5.0))
            await asyncio.sleep(0.3)
            assert PG_URL
            with psycopg.connect(PG_URL, autocommit=True) as admin:
                admin.execute("SELECT pg_terminate_backend(%s)", (first,))
            with pytest.raises(psycopg.OperationalError):
                await asyncio.wait_for(slow, 10)
            assert connection.closed
            assert getattr(connection, "_watched", None) == -1
            return first, await asyncio.wait_for(_backend_pid(pg), 10)
        finally:
            await pg.close()

    first, replaced = _run(main, loop)
    assert replaced != first
