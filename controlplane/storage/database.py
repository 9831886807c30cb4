"""The database handle: SQLite in WAL mode with foreign keys on, or PostgreSQL through psycopg 3."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from sqlalchemy import event, exc
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.pool import ConnectionPoolEntry, PoolProxiedConnection
from sqlmodel import create_engine

from shared.errors import ConfigurationError


def normalize_url(url: str) -> str:
    """Accept ``postgresql://`` / ``postgres://`` and use the psycopg 3 driver for them."""
    try:
        parsed = make_url(url)
    except Exception as exc:
        raise ConfigurationError(f"TIERLINE_DATABASE_URL is not a database URL: {exc}") from exc
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    if parsed.get_backend_name() not in ("sqlite", "postgresql"):
        raise ConfigurationError(f"unsupported database {parsed.get_backend_name()!r}; use sqlite or postgresql")
    return parsed.render_as_string(hide_password=False)


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA busy_timeout=5000")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.close()


# A pooled connection back in the pool for less than this is handed out again without a ping first.
PING_IDLE_S = 2.0


def _ping_when_idle(db: Engine, idle_s: float) -> None:
    """SQLAlchemy's pre-ping, only for connections idle ``idle_s`` or more (and new ones).

    ``pool_pre_ping`` costs a round trip on every checkout: three of a streamed request's 17. A connection that
    was in use a moment ago is alive as far as a ping could tell; if the server went away since, the statement
    fails as a disconnect, which invalidates the whole pool (SQLAlchemy's default), so the connections after it
    are fresh: the requests in that gap fail as they would have failed mid-transaction anyway.
    """

    def checkin(_dbapi_connection: Any, record: ConnectionPoolEntry) -> None:
        record.info["checked_in_at"] = time.monotonic()

    def checkout(dbapi_connection: Any, record: ConnectionPoolEntry, _proxy: PoolProxiedConnection) -> None:
        checked_in_at = record.info.get("checked_in_at")
        if checked_in_at is not None and time.monotonic() - checked_in_at < idle_s:
            return
        try:
            db.dialect.do_ping(dbapi_connection)
        except db.dialect.loaded_dbapi.Error as err:
            if db.dialect.is_disconnect(err, dbapi_connection, None):
                raise exc.InvalidatePoolError("the database connection was lost") from err  # reconnects
            raise

    event.listen(db.pool, "checkin", checkin)
    event.listen(db.pool, "checkout", checkout)


def create_db(url: str, *, echo: bool = False, pool_size: int = 10) -> Engine:
    """A SQLAlchemy engine for ``url``: the database handle the services call ``db``."""
    url = normalize_url(url)
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        if parsed.database and parsed.database != ":memory:":
            Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
        db = create_engine(url, echo=echo, connect_args={"check_same_thread": False})
        event.listen(db, "connect", _sqlite_pragmas)
        return db
    db = create_engine(url, echo=echo, pool_size=pool_size)
    _ping_when_idle(db, PING_IDLE_S)
    return db
