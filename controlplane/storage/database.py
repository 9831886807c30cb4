"""The database handle: SQLite in WAL mode with foreign keys on, or PostgreSQL through psycopg 3."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sqlalchemy import event
from sqlalchemy.engine import Engine, make_url
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
    return create_engine(url, echo=echo, pool_size=pool_size, pool_pre_ping=True)
