"""The process-wide database handle and short-lived sessions, built from ``DatabaseSettings``."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache

from sqlalchemy.engine import Engine
from sqlmodel import Session

from controlplane.storage.database import create_db
from shared.settings import DatabaseSettings


def database_url() -> str:
    return DatabaseSettings().url


@lru_cache(maxsize=4)
def _db_for(url: str, echo: bool, pool_size: int) -> Engine:
    return create_db(url, echo=echo, pool_size=pool_size)


def get_db() -> Engine:
    """The process's database handle for the configured URL (one per URL and pool settings)."""
    settings = DatabaseSettings()
    return _db_for(settings.url, settings.database_echo, settings.database_pool_size)


@contextmanager
def session_scope(db: Engine | None = None) -> Iterator[Session]:
    """A session that commits on success and rolls back on error."""
    with Session(db or get_db(), expire_on_commit=False) as session:
        try:
            yield session
            session.commit()
        except BaseException:
            session.rollback()
            raise
