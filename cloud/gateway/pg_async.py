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
import collections
import contextlib
import select
import weakref
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg.waiting import READY_R, READY_W, WAIT_R, WAIT_W
from sqlalchemy.engine import Engine


def conninfo_of(engine: Engine) -> str:
    """The libpq URL of a SQLAlchemy engine on PostgreSQL (its driver name dropped, its password kept)."""
    return engine.url.set(drivername="postgresql").render_as_string(hide_password=False)


class _WatchedConnection(psycopg.AsyncConnection[tuple[object, ...]]):
    """An ``AsyncConnection`` whose socket stays registered with the event loop while it is open.

    psycopg's own wait registers the socket for each statement and removes it after (with uvloop: six system calls
    and a poll handle a statement, and a timer for its interrupt check). Here one reader callback, added at
    connect, resolves the waiting statement's future; bytes that arrive while nothing waits (a notice, the server
    closing) are taken into libpq's buffer there, so that the watch does not fire again, and a connection that
    fails stops being watched. Waits with a timeout (connecting, cancelling) are psycopg's own.
    """

    _waiter: asyncio.Future[None] | None = None
    _watched: int = -1
    _loop: asyncio.AbstractEventLoop | None = None

    def watch(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._watched = self.pgconn.socket
        self._loop.add_reader(self._watched, self._readable)

    def unwatch(self) -> None:
        if self._watched >= 0 and self._loop is not None:
            with contextlib.suppress(Exception):
                self._loop.remove_reader(self._watched)
        self._watched = -1

    def _readable(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
            return
        try:
            self.pgconn.consume_input()
        except Exception:
            self.unwatch()  # the connection failed: its next statement says so

    async def wait(self, gen: Any, interval: float = 0.1, timeout: float | None = None) -> Any:
        if self._watched < 0 or timeout is not None:
            return await super().wait(gen, interval, timeout)
        loop = self._loop
        assert loop is not None
        try:
            state = next(gen)
            while True:
                if state & WAIT_W:  # a statement larger than the socket's buffer: wait until it takes more
                    readable, writable, _ = select.select([self._watched], [self._watched], [], 0)
                    if not writable:
                        waiter = loop.create_future()
                        loop.add_writer(self._watched, waiter.set_result, None)
                        try:
                            await waiter
                        finally:
                            loop.remove_writer(self._watched)
                        readable, writable, _ = select.select([self._watched], [self._watched], [], 0)
                    state = gen.send((READY_R if readable else 0) | (READY_W if writable else 0))
                    continue
                if not state & WAIT_R:
                    raise psycopg.InternalError(f"bad poll status: {state}")
                waiter = self._waiter = loop.create_future()
                try:
                    await waiter
                finally:
                    self._waiter = None
                state = gen.send(READY_R)
        except StopIteration as done:
            return done.value
        except OSError as exc:
            self.unwatch()
            raise psycopg.OperationalError("connection socket closed") from exc
        except BaseException:
            if self.closed:  # libpq dropped the connection and closed its socket: its number may be reused
                self.unwatch()
            raise

    async def close(self) -> None:
        self.unwatch()
        await super().close()


class _LoopPool:
    """The connections of one event loop, each with the cursor its statements reuse.

    Taking an idle connection and giving one back are plain calls (no lock, no task): each statement of the hot
    path takes and gives back one, so a condition variable and a shielded task per give-back cost more than the
    statement's own Python work. Waiters (all ``size`` connections in use) queue in order; a give-back wakes the
    first that still waits.
    """

    def __init__(self, conninfo: str, size: int) -> None:
        self.conninfo = conninfo
        self.size = size
        self.idle: list[_Pooled] = []
        self.opened = 0
        self.closed = False
        self.waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self.closing: set[asyncio.Task[None]] = set()

    async def get(self) -> _Pooled:
        while not self.idle and self.opened >= self.size:
            waiter = asyncio.get_running_loop().create_future()
            self.waiters.append(waiter)
            try:
                await waiter
            except asyncio.CancelledError:
                if waiter.done() and not waiter.cancelled():
                    self._wake()  # woken, then cancelled: the wake-up goes to the next waiter
                else:
                    with contextlib.suppress(ValueError):
                        self.waiters.remove(waiter)
                raise
        if self.idle:
            return self.idle.pop()
        self.opened += 1
        try:
            connection = await _WatchedConnection.connect(self.conninfo, autocommit=True)
        except BaseException:
            self._lost()
            raise
        connection.watch()
        return _Pooled(connection, connection.cursor())

    def put(self, pooled: _Pooled, *, broken: bool) -> None:
        if broken or pooled.connection.closed or self.closed:
            self._lost()
            if pooled.connection.closed:
                pooled.connection.unwatch()  # closed by libpq, not by close()
            if not pooled.connection.closed:
                task = asyncio.get_running_loop().create_task(_close(pooled.connection))
                self.closing.add(task)
                task.add_done_callback(self.closing.discard)
            return
        self.idle.append(pooled)
        self._wake()

    def _lost(self) -> None:
        self.opened -= 1
        self._wake()

    def _wake(self) -> None:
        while self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    async def close(self) -> None:
        self.closed = True
        idle, self.idle = self.idle, []
        self.opened -= len(idle)
        for pooled in idle:
            await _close(pooled.connection)
        if self.closing:
            await asyncio.wait(list(self.closing))


@dataclass(slots=True)
class _Pooled:
    connection: _WatchedConnection
    cursor: psycopg.AsyncCursor[tuple[object, ...]]  # reused: a cursor per statement costs a third of one


async def _close(connection: psycopg.AsyncConnection[tuple[object, ...]]) -> None:
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
    async def connection(self) -> AsyncIterator[psycopg.AsyncCursor[tuple[object, ...]]]:
        """The cursor of a connection of this loop's pool, for one statement (or a few: each ``execute`` returns
        the cursor, as ``AsyncConnection.execute`` does), given back after."""
        pool = self._pool()
        pooled = await pool.get()
        broken = True
        try:
            yield pooled.cursor
            broken = False
        except psycopg.Error as exc:  # a statement that failed cleanly (a constraint) leaves it usable
            broken = not isinstance(exc, psycopg.DatabaseError) or isinstance(exc, psycopg.OperationalError)
            raise
        finally:
            pool.put(pooled, broken=broken)  # a plain call: the client leaving cannot interrupt it

    async def close(self) -> None:
        """Close the idle connections of the current loop's pool (those in use are closed when given back)."""
        pool = self._pools.pop(asyncio.get_running_loop(), None)
        if pool is not None:
            await pool.close()
