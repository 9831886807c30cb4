"""PostgreSQL on the event loop: a small pool of psycopg ``AsyncConnection``s per event loop, for the gateway's
billing hot path (``controlplane.billing.hotpath``), whose statements are awaited here instead of occupying a
worker thread and a SQLAlchemy session each.

Connections are in autocommit mode: each hot-path statement is its own transaction. A pool holds at most
``size`` connections (``TIERLINE_DATABASE_POOL_SIZE``, in addition to the SQLAlchemy engine's own pool), opened
on first use; a request waits for a free one beyond that. A connection that fails, or whose statement is
interrupted (the task cancelled mid-query), is closed rather than handed out again: its state is unknown.
"""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from collections.abc import AsyncIterator

import psycopg
from sqlalchemy.engine import Engine


def conninfo_of(engine: Engine) -> str:
    """The libpq URL of a SQLAlchemy engine on PostgreSQL (its driver name dropped, its password kept)."""
    return engine.url.set(drivername="postgresql").render_as_string(hide_password=False)


class _LoopPool:
    """The connections of one event loop."""

    def __init__(self, conninfo: str, size: int) -> None:
        self.conninfo = conninfo
        self.size = size
        self.idle: list[psycopg.AsyncConnection[tuple[object, ...]]] = []
        self.opened = 0
        self.closed = False
        self.freed = asyncio.Condition()

    async def get(self) -> psycopg.AsyncConnection[tuple[object, ...]]:
        async with self.freed:
            while not self.idle and self.opened >= self.size:
                await self.freed.wait()
            if self.idle:
                return self.idle.pop()
            self.opened += 1
        try:
            return await psycopg.AsyncConnection.connect(self.conninfo, autocommit=True)
        except BaseException:
            await self._lost()
            raise

    async def put(self, connection: psycopg.AsyncConnection[tuple[object, ...]], *, broken: bool) -> None:
        if broken or connection.closed or self.closed:
            with contextlib.suppress(Exception):
                await connection.close()
            await self._lost()
            return
        async with self.freed:
            self.idle.append(connection)
            self.freed.notify()

    async def _lost(self) -> None:
        async with self.freed:
            self.opened -= 1
            self.freed.notify()

    async def close(self) -> None:
        async with self.freed:
            self.closed = True
            idle, self.idle = self.idle, []
            self.opened -= len(idle)
        for connection in idle:
            with contextlib.suppress(Exception):
                await connection.close()


class AsyncPostgres:
    """Per event loop, a pool of at most ``size`` autocommit connections to the engine's database.

    A pool belongs to the loop that opened it (an asyncio connection cannot be awaited from another loop), so a
    process that runs several loops (tests, the CLI) gets one each; ``close()`` closes the current loop's.
    """

    def __init__(self, engine: Engine, size: int = 10) -> None:
        if engine.dialect.name != "postgresql":
            raise ValueError(f"AsyncPostgres needs PostgreSQL, not {engine.dialect.name}")
        self.conninfo = conninfo_of(engine)
        self.size = max(1, size)
        self._pools: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopPool] = weakref.WeakKeyDictionary()

    def _pool(self) -> _LoopPool:
        loop = asyncio.get_running_loop()
        pool = self._pools.get(loop)
        if pool is None:
            pool = self._pools[loop] = _LoopPool(self.conninfo, self.size)
        return pool

    @contextlib.asynccontextmanager
    async def connection(self) -> AsyncIterator[psycopg.AsyncConnection[tuple[object, ...]]]:
        """A connection of this loop's pool for one statement (or a few), given back after."""
        pool = self._pool()
        connection = await pool.get()
        broken = True
        try:
            yield connection
            broken = False
        except psycopg.Error as exc:  # a statement that failed cleanly (a constraint) leaves it usable
            broken = not isinstance(exc, psycopg.DatabaseError) or isinstance(exc, psycopg.OperationalError)
            raise
        finally:
            await asyncio.shield(pool.put(connection, broken=broken))

    async def close(self) -> None:
        """Close the idle connections of the current loop's pool (those in use are closed when given back)."""
        pool = self._pools.pop(asyncio.get_running_loop(), None)
        if pool is not None:
            await pool.close()
