"""Console sessions kept on the server, so signing out, a password reset or an admin can end them at once.

The session id is random (144 bits) and lives only in the browser's signed cookie; the table keeps its sha256.
A session is valid while it is neither revoked nor expired and its user is enabled.
"""

from __future__ import annotations

import hashlib
from datetime import UTC, datetime, timedelta

from sqlalchemy import delete
from sqlmodel import Session, col, select, update

from controlplane.storage.tables import ConsoleSession, ConsoleUser

LOCK_MARK = "!"  # a disabled user's password hash starts with it (controlplane.accounts.users)
_LAST_SEEN_GRANULARITY = timedelta(minutes=5)  # last_seen_at is written at most this often per session
_KEEP_EXPIRED = timedelta(days=7)  # expired and revoked records stay this long, for the user page


def hash_session_id(session_id: str) -> str:
    return hashlib.sha256(session_id.encode()).hexdigest()


def _aware(ts: datetime) -> datetime:
    return ts if ts.tzinfo else ts.replace(tzinfo=UTC)


def open_session(
    session: Session, user_id: int, session_id: str, *, max_age_s: int, client: str = "", user_agent: str = ""
) -> ConsoleSession:
    """Record a new signed-in session (and forget sessions that ended long ago)."""
    now = datetime.now(UTC)
    session.execute(delete(ConsoleSession).where(col(ConsoleSession.expires_at) < now - _KEEP_EXPIRED))
    record = ConsoleSession(
        session_hash=hash_session_id(session_id),
        user_id=user_id,
        created_at=now,
        expires_at=now + timedelta(seconds=max_age_s),
        last_seen_at=now,
        client=client[:64],
        user_agent=user_agent[:200],
    )
    session.add(record)
    session.flush()
    return record


def active_user(session: Session, session_id: str) -> ConsoleUser | None:
    """The enabled user of a live session, or None when the session is unknown, revoked or expired."""
    row = session.exec(
        select(ConsoleSession, ConsoleUser)
        .join(ConsoleUser)
        .where(ConsoleSession.session_hash == hash_session_id(session_id))
    ).first()
    if row is None:
        return None
    record, user = row
    now = datetime.now(UTC)
    if record.revoked_at is not None or _aware(record.expires_at) <= now or user.password_hash.startswith(LOCK_MARK):
        return None
    if _aware(record.last_seen_at) < now - _LAST_SEEN_GRANULARITY:
        session.execute(update(ConsoleSession).where(col(ConsoleSession.id) == record.id).values(last_seen_at=now))
        session.commit()
        # The commit expired the user; the caller reads it after its session closes (DetachedInstanceError).
        session.refresh(user)
    return user


def revoke_session(session: Session, session_id: str) -> bool:
    """End one session (signing out); False when it had already ended."""
    result = session.execute(
        update(ConsoleSession)
        .where(
            col(ConsoleSession.session_hash) == hash_session_id(session_id), col(ConsoleSession.revoked_at).is_(None)
        )
        .values(revoked_at=datetime.now(UTC))
    )
    return bool(result.rowcount)  # type: ignore[attr-defined]


def revoke_user_sessions(session: Session, user_id: int) -> int:
    """End every live session of a user; returns how many."""
    result = session.execute(
        update(ConsoleSession)
        .where(
            col(ConsoleSession.user_id) == user_id,
            col(ConsoleSession.revoked_at).is_(None),
            col(ConsoleSession.expires_at) > datetime.now(UTC),
        )
        .values(revoked_at=datetime.now(UTC))
    )
    return int(result.rowcount)  # type: ignore[attr-defined]


def list_sessions(session: Session, user_id: int, *, limit: int = 50) -> list[ConsoleSession]:
    """A user's sessions, newest first (ended ones too, for a while)."""
    query = (
        select(ConsoleSession)
        .where(ConsoleSession.user_id == user_id)
        .order_by(col(ConsoleSession.id).desc())
        .limit(limit)
    )
    return list(session.exec(query).all())


def is_live(record: ConsoleSession) -> bool:
    return record.revoked_at is None and _aware(record.expires_at) > datetime.now(UTC)
