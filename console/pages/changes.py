"""The changes console pages make that no shared service covers yet, each with its audit_log row.

Tenant and key records come from :mod:`controlplane.tenancy.service`, devices and enrollment tokens from
:mod:`controlplane.fleet.devices`;
these functions add what the console needs on top (editing limits, revoking an unused enrollment token) and write
who changed what, before and after.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

from sqlmodel import Session, select

from console.pages.common import audit, jsonable
from controlplane.fleet import devices
from controlplane.storage.tables import ApiKey, Device, EnrollmentToken, Tenant
from controlplane.tenancy import service as tenancy
from shared.errors import ConflictError, NotFoundError, ValidationError

TENANT_FIELDS = (
    "display_name",
    "is_active",
    "monthly_budget",
    "currency",
    "requests_per_minute",
    "tokens_per_minute",
    "max_concurrent",
)


def tenant_json(t: Tenant) -> dict[str, Any]:
    return {"name": t.name, **{f: jsonable(getattr(t, f)) for f in TENANT_FIELDS}}


def key_json(k: ApiKey) -> dict[str, Any]:
    return {
        "id": k.id,
        "tenant_id": k.tenant_id,
        "name": k.name,
        "prefix": k.prefix,
        "expires_at": jsonable(k.expires_at),
        "revoked_at": jsonable(k.revoked_at),
    }


@dataclass(frozen=True, slots=True)
class TenantEdit:
    """What the tenant form sets; None limits fall back to the cloud's defaults."""

    display_name: str
    is_active: bool
    monthly_budget: Decimal | None
    requests_per_minute: int | None
    tokens_per_minute: int | None
    max_concurrent: int | None


def create_tenant(session: Session, name: str, edit: TenantEdit, *, actor: str) -> Tenant:
    tenant = tenancy.create_tenant(session, name, budget=edit.monthly_budget, display_name=edit.display_name)
    _apply(tenant, edit)
    session.add(tenant)
    session.flush()
    audit(session, actor, "tenant.create", f"tenant/{tenant.name}", None, tenant_json(tenant))
    return tenant


def update_tenant(session: Session, name: str, edit: TenantEdit, *, actor: str) -> Tenant:
    tenant = tenancy.get_tenant(session, name)
    before = tenant_json(tenant)
    _apply(tenant, edit)
    session.add(tenant)
    session.flush()
    after = tenant_json(tenant)
    if after != before:
        audit(session, actor, "tenant.update", f"tenant/{tenant.name}", before, after)
    return tenant


def _apply(tenant: Tenant, edit: TenantEdit) -> None:
    tenant.display_name = edit.display_name or tenant.name
    tenant.is_active = edit.is_active
    tenant.monthly_budget = edit.monthly_budget
    tenant.requests_per_minute = edit.requests_per_minute
    tenant.tokens_per_minute = edit.tokens_per_minute
    tenant.max_concurrent = edit.max_concurrent


def create_api_key(
    session: Session, tenant_name: str, name: str, expires_in_days: int | None, *, actor: str
) -> tenancy.IssuedKey:
    tenant = tenancy.get_tenant(session, tenant_name)
    expires_at = datetime.now(UTC) + timedelta(days=expires_in_days) if expires_in_days else None
    issued = tenancy.create_api_key(session, tenant, name=name, expires_at=expires_at)
    audit(session, actor, "api_key.create", f"api_key/{issued.record.id}", None, key_json(issued.record))
    return issued


def revoke_api_key(session: Session, key_id: int, *, actor: str) -> ApiKey:
    record = session.get(ApiKey, key_id)
    if record is None:
        raise NotFoundError(f"no API key with id {key_id}", param="id")
    if record.revoked_at is not None:
        raise ConflictError(f"API key {record.prefix}… is already revoked")
    before = key_json(record)
    tenancy.revoke_api_key(session, key_id)
    session.flush()
    audit(session, actor, "api_key.revoke", f"api_key/{key_id}", before, key_json(record))
    return record


def create_enrollment_token(
    session: Session, tenant_name: str, labels: dict[str, str], ttl_hours: float, *, actor: str
) -> devices.IssuedSecret:
    tenant = tenancy.get_tenant(session, tenant_name)
    issued = devices.create_enrollment_token(session, tenant, labels=labels, ttl=timedelta(hours=ttl_hours))
    after = {"tenant": tenant.name, "labels": labels, "ttl_hours": ttl_hours}
    audit(session, actor, "enrollment_token.create", f"enrollment_token/{issued.id}", None, after)
    return issued


def revoke_enrollment_token(session: Session, token_id: int, *, actor: str) -> EnrollmentToken:
    """An unused token expires now, so no device can enroll with it."""
    record = session.get(EnrollmentToken, token_id)
    if record is None:
        raise NotFoundError(f"no enrollment token with id {token_id}", param="id")
    if record.used_at is not None:
        raise ConflictError(f"enrollment token {token_id} was already used by {record.device_id}")
    before = {"expires_at": jsonable(record.expires_at)}
    record.expires_at = datetime.now(UTC)
    session.add(record)
    session.flush()
    after = {"expires_at": jsonable(record.expires_at)}
    audit(session, actor, "enrollment_token.revoke", f"enrollment_token/{token_id}", before, after)
    return record


def revoke_device(session: Session, device_id: str, *, actor: str) -> None:
    device = session.get(Device, device_id)
    if device is None:
        raise NotFoundError(f"no device {device_id!r}", param="device")
    if device.status == "revoked":
        raise ConflictError(f"device {device_id} is already revoked")
    tenant = session.get(Tenant, device.tenant_id)
    if tenant is None:
        raise ValidationError(f"device {device_id} has no tenant", param="device")
    devices.revoke_device(session, tenant, device_id)
    session.flush()
    audit(session, actor, "device.revoke", f"device/{device_id}", {"status": "active"}, {"status": "revoked"})


def tenant_names(session: Session) -> list[str]:
    return list(session.exec(select(Tenant.name).order_by(Tenant.name)))
