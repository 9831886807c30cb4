"""Console accounts on a real SQLite file and PostgreSQL: session records, the sign-in throttle (database and
Redis) under parallel attempts, and the rules that keep an admin able to sign in."""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
from sqlalchemy.engine import Engine
from sqlmodel import Session, select

from controlplane.accounts import sessions
from controlplane.accounts import users as accounts
from controlplane.accounts.login_throttle import (
    DatabaseLoginThrottle,
    LoginThrottle,
    RedisLoginThrottle,
    throttle_key,
)
from controlplane.storage.database import create_db
from controlplane.storage.session import session_scope
from controlplane.storage.tables import AuditLog, ConsoleLoginAttempt, ConsoleSession
from shared.errors import ConflictError, ValidationError

pytestmark = pytest.mark.integration

PASSWORD = "correct horse battery staple"
REDIS_URL = os.environ.get("TIERLINE_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


@pytest.fixture
def engine(migrated_db: str) -> Iterator[Engine]:
    db = create_db(migrated_db)
    yield db
    db.dispose()


def _user(engine: Engine, role: str = "admin") -> int:
    with session_scope(engine) as session:
        user = accounts.create_user(session, f"{role}-{uuid.uuid4().hex[:8]}", PASSWORD, role)
        assert user.id is not None
        return user.id


def _parallel_hits(throttle: LoginThrottle, engine: Engine, key: str, count: int) -> list[float | None]:
    barrier = threading.Barrier(count)

    def hit(_: int) -> float | None:
        barrier.wait()
        return throttle.hit(engine, key)

    with ThreadPoolExecutor(count) as pool:
        return list(pool.map(hit, range(count)))


def test_a_session_lives_until_it_is_revoked_or_expires(engine: Engine) -> None:
    uid = _user(engine)
    with session_scope(engine) as session:
        sessions.open_session(session, uid, "sid-live", max_age_s=3600, client="10.0.0.1", user_agent="test")
        sessions.open_session(session, uid, "sid-short", max_age_s=1)
    with Session(engine) as session:
        stored = session.exec(select(ConsoleSession.session_hash)).all()
        assert "sid-live" not in stored and sessions.hash_session_id("sid-live") in stored  # only the hash
        assert sessions.active_user(session, "sid-live") is not None
        assert sessions.active_user(session, "no-such-session") is None
    time.sleep(1.1)
    with session_scope(engine) as session:
        assert sessions.active_user(session, "sid-short") is None  # expired
        assert sessions.revoke_session(session, "sid-live") is True
        assert sessions.revoke_session(session, "sid-live") is False
    with Session(engine) as session:
        assert sessions.active_user(session, "sid-live") is None


def test_disabling_ends_sessions_and_refuses_the_password(engine: Engine) -> None:
    keeper, uid = _user(engine), _user(engine, "viewer")
    with session_scope(engine) as session:
        sessions.open_session(session, uid, "sid-viewer", max_age_s=3600)
        accounts.disable(session, uid, actor="test")
    with Session(engine) as session:
        user = accounts.get_user_by_id(session, uid)
        assert accounts.is_disabled(user) and not accounts.verify_password(user, PASSWORD)
        assert sessions.active_user(session, "sid-viewer") is None
    with session_scope(engine) as session:
        accounts.enable(session, uid, actor="test")
    with Session(engine) as session:
        user = accounts.get_user_by_id(session, uid)
        assert accounts.verify_password(user, PASSWORD)
        assert sessions.active_user(session, "sid-viewer") is None  # revoked sessions stay revoked
        actions = session.exec(select(AuditLog.action).where(AuditLog.target == f"console_user/{user.username}")).all()
        assert list(actions) == ["console_user.disable", "console_user.enable"]
        assert accounts.verify_password(accounts.get_user_by_id(session, keeper), PASSWORD)


def test_the_last_enabled_admin_stays_an_admin(engine: Engine) -> None:
    only = _user(engine)  # a fresh database: the one admin
    with session_scope(engine) as session, pytest.raises(ConflictError, match="last enabled admin"):
        accounts.disable(session, only, actor="test")
    with session_scope(engine) as session, pytest.raises(ConflictError, match="last enabled admin"):
        accounts.set_role(session, only, "viewer", actor="test")
    second = _user(engine)
    with session_scope(engine) as session:
        accounts.disable(session, only, actor="test", acting_user_id=second)
        with pytest.raises(ConflictError, match="your own"):
            accounts.set_role(session, second, "viewer", actor="test", acting_user_id=second)
    with session_scope(engine) as session, pytest.raises(ValidationError, match="at least 12"):
        accounts.reset_password(session, second, "short", actor="test")


def test_parallel_attempts_cannot_outrun_the_database_throttle(engine: Engine) -> None:
    throttle = DatabaseLoginThrottle(max_attempts=5, window_s=2)
    key = throttle_key("Admin", "10.0.0.9")
    results = _parallel_hits(throttle, engine, key, 16)
    assert sum(r is None for r in results) == 5
    waits = [r for r in results if r is not None]
    assert len(waits) == 11 and all(0 < w <= 2 for w in waits)
    assert throttle.hit(engine, throttle_key("admin", "10.0.0.9")) is not None  # usernames match case-blind
    assert throttle.hit(engine, throttle_key("admin", "10.0.0.10")) is None  # another address has its own count
    time.sleep(2.1)
    assert throttle.hit(engine, key) is None  # a new window
    throttle.clear(engine, key)
    with Session(engine) as session:
        keys = session.exec(select(ConsoleLoginAttempt.key)).all()
    assert key not in keys and all(len(k) == 64 and "admin" not in k for k in keys)


def test_parallel_attempts_cannot_outrun_the_redis_throttle(engine: Engine) -> None:
    import redis

    try:
        redis.Redis.from_url(REDIS_URL, socket_timeout=2).ping()
    except redis.RedisError:
        pytest.skip(f"no Redis at {REDIS_URL}")
    throttle = RedisLoginThrottle(REDIS_URL, max_attempts=5, window_s=2)
    key = throttle_key(f"user-{uuid.uuid4().hex}", "10.0.0.9")
    results = _parallel_hits(throttle, engine, key, 16)
    assert sum(r is None for r in results) == 5
    assert all(0 < r <= 2 for r in results if r is not None)
    throttle.clear(engine, key)
    assert throttle.hit(engine, key) is None
