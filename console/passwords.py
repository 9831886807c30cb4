"""Console accounts' passwords (argon2id); the service lives in :mod:`controlplane.accounts.users`."""

from __future__ import annotations

from controlplane.accounts.users import MIN_PASSWORD_LENGTH, ROLES, create_user, hash_password, user_exists

__all__ = ["MIN_PASSWORD_LENGTH", "ROLES", "create_user", "hash_password", "user_exists"]
