"""Tenants and API keys: the records both the cloud (auth) and the console (management) work with.

A key is ``tl-`` + 43 url-safe characters (32 random bytes). Only its sha256 is stored; the key itself
is returned once, at creation.
"""

from __future__ import annotations

import hashlib
import re
import secrets
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal, InvalidOperation

from sqlmodel import Session, col, select

from controlplane.storage.tables import ApiKey, Tenant
from shared.errors import AuthenticationError, ConflictError, NotFoundError, ValidationError

KEY_PREFIX = "tl-"
KEY_BYTES = 32
_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,63}$")


def hash_api_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def parse_budget(text: str | None) -> Decimal | None:
    if text is None:
        return None
    try:
        value = Decimal(text)
    except InvalidOperation:
        raise ValidationError(f"budget {text!r} is not a number", param="budget") from None
    if not value.is_finite() or value < 0:
        raise ValidationError("budget must be a non-negative amount", param="budget")
    return value


def create_tenant(session: Session, name: str, *, budget: Decimal | None = None, display_name: str = "") -> Tenant:
    if not _NAME_RE.match(name):
        raise ValidationError(
            f"tenant name {name!r} must be 1-64 chars of lowercase letters, digits, '-' or '_'", param="name"
        )
    if session.exec(select(Tenant).where(Tenant.name == name)).first() is not None:
        raise ConflictError(f"tenant {name!r} already exists", param="name")
    tenant = Tenant(name=name, display_name=display_name or name, monthly_budget=budget)
    session.add(tenant)
    session.flush()
    return tenant


def get_tenant(session: Session, name: str) -> Tenant:
    tenant = session.exec(select(Tenant).where(Tenant.name == name)).first()
    if tenant is None:
        raise NotFoundError(f"no tenant named {name!r}", param="tenant")
    return tenant


def list_tenants(session: Session) -> list[Tenant]:
    return list(session.exec(select(Tenant).order_by(Tenant.name)))


@dataclass(frozen=True, slots=True)
class IssuedKey:
    """A new key: ``secret`` is shown once and never stored."""

    record: ApiKey
    secret: str


def create_api_key(
    session: Session,
    tenant: Tenant,
    *,
    name: str = "",
    expires_at: datetime | None = None,
    allowed_models: list[str] | None = None,
) -> IssuedKey:
    if tenant.id is None:
        raise ValueError("tenant must be saved before it gets keys")
    secret = KEY_PREFIX + secrets.token_urlsafe(KEY_BYTES)
    record = ApiKey(
        tenant_id=tenant.id,
        name=name,
        prefix=secret[:10],
        key_hash=hash_api_key(secret),
        expires_at=expires_at,
        allowed_models=allowed_models,
    )
    session.add(record)
    session.flush()
    return IssuedKey(record, secret)


def list_api_keys(session: Session, tenant: Tenant) -> list[ApiKey]:
    return list(session.exec(select(ApiKey).where(ApiKey.tenant_id == tenant.id).order_by(col(ApiKey.id))))


def revoke_api_key(session: Session, key_id: int, tenant: Tenant | None = None) -> ApiKey:
    """Revoke by id; when ``tenant`` is given the key must belong to it (a caller never reaches another's)."""
    query = select(ApiKey).where(ApiKey.id == key_id)
    if tenant is not None:
        query = query.where(ApiKey.tenant_id == tenant.id)
    record = session.exec(query).first()
    if record is None:
        raise NotFoundError(f"no API key with id {key_id}", param="id")
    if record.revoked_at is None:
        record.revoked_at = datetime.now(UTC)
        session.add(record)
    return record


def authenticate(session: Session, secret: str) -> tuple[Tenant, ApiKey]:
    """The tenant and key for a bearer secret; AuthenticationError for unknown, revoked or expired keys."""
    if not secret.startswith(KEY_PREFIX):
        raise AuthenticationError("invalid API key")
    row = session.exec(select(ApiKey, Tenant).join(Tenant).where(ApiKey.key_hash == hash_api_key(secret))).first()
    if row is None:
        raise AuthenticationError("invalid API key")
    key, tenant = row
    now = datetime.now(UTC)
    if key.revoked_at is not None:
        raise AuthenticationError("API key has been revoked")
    if key.expires_at is not None and key.expires_at <= now:
        raise AuthenticationError("API key has expired")
    if not tenant.is_active:
        raise AuthenticationError("tenant is disabled")
    return tenant, key
