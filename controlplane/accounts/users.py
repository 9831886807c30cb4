"""Console users: argon2id password hashes, roles, disabling, and revoking a user's API tokens.

A disabled user keeps its row and password hash, locked with a leading ``!`` the way ``usermod -L`` locks a Unix
password: no password verifies against it, and enabling the user removes the mark. Disabling, like a password
reset, also ends every session of the user; disabling revokes its API tokens too.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from argon2 import PasswordHasher
from argon2.exceptions import InvalidHashError, VerificationError
from sqlalchemy import func
from sqlmodel import Session, col, select, update

from controlplane.accounts import sessions
from controlplane.storage.tables import AuditLog, ConsoleSession, ConsoleToken, ConsoleUser
from shared.errors import ConflictError, NotFoundError, ValidationError

ROLES = ("admin", "viewer")
MIN_PASSWORD_LENGTH = 12
MAX_PASSWORD_LENGTH = 1024
LOCK_MARK = sessions.LOCK_MARK
_hasher = PasswordHasher()  # argon2id with the library's current recommended parameters
# Verified when the username is unknown or disabled, so those take as long as a wrong password.
_DUMMY_HASH = _hasher.hash(secrets.token_urlsafe(16))


def hash_password(password: str) -> str:
    _check_password(password)
    return _hasher.hash(password)


def is_disabled(user: ConsoleUser) -> bool:
    return user.password_hash.startswith(LOCK_MARK)


def verify_password(user: ConsoleUser | None, password: str) -> bool:
    """Whether ``password`` is the enabled ``user``'s; always runs one argon2 verification."""
    usable = user is not None and not is_disabled(user) and len(password) <= MAX_PASSWORD_LENGTH
    try:
        stored = user.password_hash if user is not None and usable else _DUMMY_HASH
        _hasher.verify(stored, password[:MAX_PASSWORD_LENGTH])
    except (VerificationError, InvalidHashError):
        return False
    return usable


def _check_password(password: str) -> None:
    if len(password) < MIN_PASSWORD_LENGTH:
        raise ValidationError(f"password must be at least {MIN_PASSWORD_LENGTH} characters", param="password")
    if len(password) > MAX_PASSWORD_LENGTH:
        raise ValidationError(f"password must be at most {MAX_PASSWORD_LENGTH} characters", param="password")


def _check_role(role: str) -> None:
    if role not in ROLES:
        raise ValidationError(f"role must be one of {', '.join(ROLES)}", param="role")


def user_json(user: ConsoleUser) -> dict[str, Any]:
    """What the audit log records of a user: never the password hash."""
    return {"username": user.username, "role": user.role, "disabled": is_disabled(user)}


def _audit(session: Session, actor: str, action: str, target: str, before: Any, after: Any) -> None:
    session.add(AuditLog(actor=actor[:128], action=action, target=target[:256], before=before, after=after))


def create_user(
    session: Session, username: str, password: str, role: str = "admin", *, actor: str | None = None
) -> ConsoleUser:
    """A new console user; with ``actor`` (an operator's change) an audit row too."""
    _check_role(role)
    if not username or len(username) > 64 or username != username.strip():
        raise ValidationError("username must be 1-64 characters without surrounding spaces", param="username")
    _check_password(password)
    if user_exists(session, username):
        raise ConflictError(f"console user {username!r} already exists", param="username")
    user = ConsoleUser(username=username, password_hash=hash_password(password), role=role)
    session.add(user)
    session.flush()
    if actor is not None:
        _audit(session, actor, "console_user.create", f"console_user/{username}", None, user_json(user))
    return user


def user_exists(session: Session, username: str) -> bool:
    return session.exec(select(ConsoleUser).where(ConsoleUser.username == username)).first() is not None


def get_user(session: Session, username: str) -> ConsoleUser:
    user = session.exec(select(ConsoleUser).where(ConsoleUser.username == username)).first()
    if user is None:
        raise NotFoundError(f"no console user named {username!r}", param="username")
    return user


def get_user_by_id(session: Session, user_id: int) -> ConsoleUser:
    user = session.get(ConsoleUser, user_id)
    if user is None:
        raise NotFoundError(f"no console user with id {user_id}", param="id")
    return user


@dataclass(frozen=True, slots=True)
class UserSummary:
    """A row of the user list: the user with its live sessions and tokens counted."""

    user: ConsoleUser
    num_sessions: int
    num_tokens: int

    @property
    def is_disabled(self) -> bool:
        return is_disabled(self.user)


def list_users(session: Session) -> list[UserSummary]:
    now = datetime.now(UTC)
    live_sessions = dict(
        session.exec(
            select(ConsoleSession.user_id, func.count())
            .where(col(ConsoleSession.revoked_at).is_(None), col(ConsoleSession.expires_at) > now)
            .group_by(col(ConsoleSession.user_id))
        ).all()
    )
    live_tokens = dict(
        session.exec(
            select(ConsoleToken.user_id, func.count())
            .where(col(ConsoleToken.revoked_at).is_(None))
            .group_by(col(ConsoleToken.user_id))
        ).all()
    )
    users = session.exec(select(ConsoleUser).order_by(col(ConsoleUser.username))).all()
    return [UserSummary(u, live_sessions.get(u.id or 0, 0), live_tokens.get(u.id or 0, 0)) for u in users]


def list_tokens(session: Session, user_id: int) -> list[ConsoleToken]:
    query = select(ConsoleToken).where(ConsoleToken.user_id == user_id).order_by(col(ConsoleToken.id).desc())
    return list(session.exec(query).all())


def _num_enabled_admins(session: Session) -> int:
    admins = session.exec(select(ConsoleUser).where(ConsoleUser.role == "admin")).all()
    return sum(1 for u in admins if not is_disabled(u))


def _refuse_self(user: ConsoleUser, acting_user_id: int | None, what: str) -> None:
    if acting_user_id is not None and user.id == acting_user_id:
        raise ConflictError(f"you cannot {what} your own account; another admin can")


def set_role(
    session: Session, user_id: int, role: str, *, actor: str, acting_user_id: int | None = None
) -> ConsoleUser:
    _check_role(role)
    user = get_user_by_id(session, user_id)
    if user.role == role:
        return user
    _refuse_self(user, acting_user_id, "change the role of")
    if user.role == "admin" and not is_disabled(user) and _num_enabled_admins(session) <= 1:
        raise ConflictError("the last enabled admin cannot become a viewer; make another admin first")
    before = user_json(user)
    user.role = role
    session.add(user)
    session.flush()
    _audit(session, actor, "console_user.role", f"console_user/{user.username}", before, user_json(user))
    return user


def reset_password(session: Session, user_id: int, password: str, *, actor: str) -> int:
    """Set a new password and end every session of the user; returns how many sessions ended."""
    user = get_user_by_id(session, user_id)
    new_hash = hash_password(password)
    user.password_hash = LOCK_MARK + new_hash if is_disabled(user) else new_hash
    session.add(user)
    ended = sessions.revoke_user_sessions(session, user_id)
    _audit(
        session,
        actor,
        "console_user.password_reset",
        f"console_user/{user.username}",
        None,
        {"sessions_ended": ended},
    )
    return ended


def disable(session: Session, user_id: int, *, actor: str, acting_user_id: int | None = None) -> ConsoleUser:
    """Lock the password, end every session and revoke every API token of the user."""
    user = get_user_by_id(session, user_id)
    if is_disabled(user):
        return user
    _refuse_self(user, acting_user_id, "disable")
    if user.role == "admin" and _num_enabled_admins(session) <= 1:
        raise ConflictError("the last enabled admin cannot be disabled; make another admin first")
    before = user_json(user)
    user.password_hash = LOCK_MARK + user.password_hash
    session.add(user)
    ended = sessions.revoke_user_sessions(session, user_id)
    revoked = _revoke_user_tokens(session, user_id)
    after = {**user_json(user), "sessions_ended": ended, "tokens_revoked": revoked}
    _audit(session, actor, "console_user.disable", f"console_user/{user.username}", before, after)
    return user


def enable(session: Session, user_id: int, *, actor: str) -> ConsoleUser:
    """Unlock the password (sessions and tokens revoked on disabling stay revoked)."""
    user = get_user_by_id(session, user_id)
    if not is_disabled(user):
        return user
    before = user_json(user)
    user.password_hash = user.password_hash.removeprefix(LOCK_MARK)
    session.add(user)
    session.flush()
    _audit(session, actor, "console_user.enable", f"console_user/{user.username}", before, user_json(user))
    return user


def revoke_sessions(session: Session, user_id: int, *, actor: str) -> int:
    """End every session of the user (it signs in again); returns how many ended."""
    user = get_user_by_id(session, user_id)
    ended = sessions.revoke_user_sessions(session, user_id)
    _audit(
        session, actor, "console_user.revoke_sessions", f"console_user/{user.username}", None, {"sessions_ended": ended}
    )
    return ended


def _revoke_user_tokens(session: Session, user_id: int) -> int:
    result = session.execute(
        update(ConsoleToken)
        .where(col(ConsoleToken.user_id) == user_id, col(ConsoleToken.revoked_at).is_(None))
        .values(revoked_at=datetime.now(UTC))
    )
    return int(result.rowcount)  # type: ignore[attr-defined]


def revoke_token(session: Session, token_id: int, *, actor: str, user_id: int | None = None) -> ConsoleToken:
    """Revoke a console API token at once (``user_id``: only when it belongs to that user)."""
    token = session.get(ConsoleToken, token_id)
    if token is None or (user_id is not None and token.user_id != user_id):
        raise NotFoundError(f"no console API token with id {token_id}", param="id")
    if token.revoked_at is not None:
        return token
    token.revoked_at = datetime.now(UTC)
    session.add(token)
    session.flush()
    owner = session.get(ConsoleUser, token.user_id)
    _audit(
        session,
        actor,
        "console_token.revoke",
        f"console_token/{token.id}",
        None,
        {"prefix": token.prefix, "name": token.name, "user": owner.username if owner else None},
    )
    return token
