"""Sign-in attempts per (username, address) in a fixed window, counted atomically *before* the password check.

Counting first means parallel guesses cannot all pass the check while none has been recorded yet: each attempt
takes one slot in a single atomic step, and once ``max_attempts`` slots of the window are taken the rest are
refused until the window ends. A successful sign-in clears the count. The counter is shared by every console
replica: one conditional upsert on the database (SQLite or PostgreSQL), or INCR on Redis when
``TIERLINE_REDIS_URL`` is set.
"""

from __future__ import annotations

import hashlib
from datetime import UTC, datetime, timedelta
from typing import Any, Protocol

from sqlalchemy import case, delete, literal, or_, select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.engine import Engine

from controlplane.storage.tables import ConsoleLoginAttempt
from shared.errors import ServiceUnavailableError

_TABLE: Any = ConsoleLoginAttempt.__table__  # type: ignore[attr-defined]


def throttle_key(username: str, address: str) -> str:
    """The counter's key: a hash, so neither the username typed nor the address is stored as is."""
    return hashlib.sha256(f"{username.lower()}\0{address}".encode()).hexdigest()


class LoginThrottle(Protocol):
    max_attempts: int
    window_s: int

    def hit(self, db: Engine, key: str) -> float | None:
        """Count one attempt: None when it may go ahead, else the seconds until the window ends."""

    def clear(self, db: Engine, key: str) -> None:
        """Forget the attempts of ``key`` (after a successful sign-in)."""


class DatabaseLoginThrottle:
    """The counter as a row per key in ``console_login_attempt``, taken with one conditional upsert."""

    def __init__(self, max_attempts: int, window_s: int = 60) -> None:
        self.max_attempts = max_attempts
        self.window_s = window_s

    def hit(self, db: Engine, key: str) -> float | None:
        now = datetime.now(UTC)
        window_start = _TABLE.c.window_start
        expired = window_start <= now - timedelta(seconds=self.window_s)
        insert = pg_insert if db.dialect.name == "postgresql" else sqlite_insert
        # One statement: a new key starts a window; an expired window restarts; a live one counts only while it
        # has room. Row locks (PostgreSQL) or the write lock (SQLite) serialise concurrent attempts on one key.
        stmt = (
            insert(_TABLE)
            .values(key=key, attempts=1, window_start=now)
            .on_conflict_do_update(
                index_elements=[_TABLE.c.key],
                set_={
                    "attempts": case((expired, 1), else_=_TABLE.c.attempts + 1),
                    "window_start": case((expired, literal(now, window_start.type)), else_=window_start),
                },
                where=or_(expired, _TABLE.c.attempts < self.max_attempts),
            )
            .returning(_TABLE.c.attempts)
        )
        with db.begin() as conn:
            counted = conn.execute(stmt).scalar()
            if counted == 1:  # a fresh window: drop the finished windows of other keys
                conn.execute(delete(_TABLE).where(expired, _TABLE.c.key != key))
            if counted is not None:
                return None
            started = conn.execute(select(window_start).where(_TABLE.c.key == key)).scalar_one()
        started = started if started.tzinfo else started.replace(tzinfo=UTC)
        # ``now`` was read before this statement waited for the lock; a window may have started after it.
        return min(self.window_s, max(0.0, (started + timedelta(seconds=self.window_s) - now).total_seconds()))

    def clear(self, db: Engine, key: str) -> None:
        with db.begin() as conn:
            conn.execute(delete(_TABLE).where(_TABLE.c.key == key))


class RedisLoginThrottle:
    """The counter as a Redis key that expires with its window: SET NX EX, then INCR, in one transaction."""

    def __init__(self, url: str, max_attempts: int, window_s: int = 60) -> None:
        import redis

        self.max_attempts = max_attempts
        self.window_s = window_s
        self._redis = redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=5)
        self._errors = (redis.RedisError,)

    def _name(self, key: str) -> str:
        return f"tierline:console-login:{key}"

    def hit(self, db: Engine, key: str) -> float | None:
        name = self._name(key)
        try:
            pipe = self._redis.pipeline(transaction=True)
            pipe.set(name, 0, ex=self.window_s, nx=True)
            pipe.incr(name)
            pipe.pttl(name)
            _, count, ttl_ms = pipe.execute()
        except self._errors as exc:
            raise ServiceUnavailableError(f"sign-in is unavailable: Redis does not answer ({exc})") from exc
        if int(count) <= self.max_attempts:
            return None
        return max(0.0, int(ttl_ms) / 1000)

    def clear(self, db: Engine, key: str) -> None:
        try:
            self._redis.delete(self._name(key))
        except self._errors as exc:
            raise ServiceUnavailableError(f"sign-in is unavailable: Redis does not answer ({exc})") from exc


def login_throttle(max_attempts: int, redis_url: str | None, window_s: int = 60) -> LoginThrottle:
    """Redis when a URL is configured (shared by the replicas that use it), the database otherwise."""
    if redis_url:
        return RedisLoginThrottle(redis_url, max_attempts, window_s)
    return DatabaseLoginThrottle(max_attempts, window_s)
