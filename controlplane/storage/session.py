"""The process-wide database handle and short-lived sessions, built from ``DatabaseSettings``."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager

from sqlalchemy.engine import Engine
from sqlmodel import Session

from controlplane.storage.database import create_db
from shared.settings import DatabaseSettings


def database_url() -> str:
    return DatabaseSettings().url


# The handles of the last few URLs a process asked for (a server has one; a test process runs the CLIs on many).
MAX_HANDLES = 4
_handles: OrderedDict[tuple[str, bool, int], Engine] = OrderedDict()
_handles_lock = threading.Lock()


def _db_for(url: str, echo: bool, pool_size: int) -> Engine:
    """The handle for these settings, made on first use. The least recently used one past ``MAX_HANDLES`` is
    disposed of, closing its idle connections (dropped without that, they stayed open until the garbage collector
    found them, and a server's connection slots with them)."""
    key = (url, echo, pool_size)
    with _handles_lock:
        db = _handles.get(key)
        if db is None:
            db = _handles[key] = create_db(url, echo=echo, pool_size=pool_size)
            while len(_handles) > MAX_HANDLES:
                _, evicted = _handles.popitem(last=False)
                evicted.dispose()  # (one checked out just now stays open until collected)
        else:
            _handles.move_to_end(key)
        return db


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
