"""Console admin accounts: argon2id password hashes."""

from __future__ import annotations

from argon2 import PasswordHasher
from sqlmodel import Session, select

from controlplane.storage.tables import ConsoleUser
from shared.errors import ConflictError, ValidationError

ROLES = ("admin", "viewer")
MIN_PASSWORD_LENGTH = 12
_hasher = PasswordHasher()  # argon2id with the library's current recommended parameters


def hash_password(password: str) -> str:
    return _hasher.hash(password)


def create_user(session: Session, username: str, password: str, role: str = "admin") -> ConsoleUser:
    if role not in ROLES:
        raise ValidationError(f"role must be one of {', '.join(ROLES)}", param="role")
    if not username or len(username) > 64:
        raise ValidationError("username must be 1-64 characters", param="username")
    if len(password) < MIN_PASSWORD_LENGTH:
        raise ValidationError(f"password must be at least {MIN_PASSWORD_LENGTH} characters", param="password")
    if session.exec(select(ConsoleUser).where(ConsoleUser.username == username)).first():
        raise ConflictError(f"console user {username!r} already exists", param="username")
    user = ConsoleUser(username=username, password_hash=hash_password(password), role=role)
    session.add(user)
    session.flush()
    return user


def user_exists(session: Session, username: str) -> bool:
    return session.exec(select(ConsoleUser).where(ConsoleUser.username == username)).first() is not None
