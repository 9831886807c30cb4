"""Devices: one-time enrollment tokens, device credentials, and idempotent ingestion of what devices report.

Tokens and credentials are random secrets shown once; only their sha256 is stored. Every query is scoped by
the device's tenant.
"""

from __future__ import annotations

import hashlib
import secrets
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import update
from sqlmodel import Session, col, select

from controlplane.billing.ledger import NewUsage, ingest_usage
from controlplane.billing.pricing import PriceLookup
from controlplane.rollouts.service import load_plans, usage_arm
from controlplane.storage.tables import Device, DeviceEvent, EnrollmentToken, Tenant
from shared.edge_protocol import EventItem, UsageItem, version_number
from shared.errors import AuthenticationError, ValidationError

ENROLL_PREFIX = "tle-"
DEVICE_PREFIX = "tld-"


def _hash(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class IssuedSecret:
    id: str
    secret: str


def create_enrollment_token(
    session: Session, tenant: Tenant, *, labels: dict[str, str] | None = None, ttl: timedelta = timedelta(days=1)
) -> IssuedSecret:
    if tenant.id is None:
        raise ValueError("tenant must be saved first")
    if ttl <= timedelta(0):
        raise ValidationError("ttl must be positive", param="ttl")
    secret = ENROLL_PREFIX + secrets.token_urlsafe(32)
    record = EnrollmentToken(
        tenant_id=tenant.id,
        token_hash=_hash(secret),
        labels=dict(labels or {}),
        expires_at=datetime.now(UTC) + ttl,
    )
    session.add(record)
    session.flush()
    return IssuedSecret(str(record.id), secret)


def enroll(
    session: Session, token: str, *, name: str, labels: dict[str, str], agent_version: str, runtime: dict[str, Any]
) -> tuple[Device, Tenant, str]:
    """Exchange a one-time token for a device and its credential (returned once)."""
    record = session.exec(select(EnrollmentToken).where(EnrollmentToken.token_hash == _hash(token))).first()
    if record is None:
        raise AuthenticationError("invalid enrollment token")
    if record.used_at is not None:
        raise AuthenticationError("enrollment token has already been used")
    if record.expires_at <= datetime.now(UTC):
        raise AuthenticationError("enrollment token has expired")
    tenant = session.get(Tenant, record.tenant_id)
    if tenant is None or not tenant.is_active:
        raise AuthenticationError("the enrollment token's tenant is disabled")
    device_id = "dev-" + uuid.uuid4().hex[:20]
    # Claim the token atomically: of two concurrent enrolls with one token, exactly one wins.
    claimed = session.execute(
        update(EnrollmentToken)
        .where(col(EnrollmentToken.id) == record.id, col(EnrollmentToken.used_at).is_(None))
        .values(used_at=datetime.now(UTC), device_id=device_id)
    )
    if claimed.rowcount != 1:  # type: ignore[attr-defined]
        raise AuthenticationError("enrollment token has already been used")
    secret = DEVICE_PREFIX + secrets.token_urlsafe(32)
    device = Device(
        id=device_id,
        tenant_id=record.tenant_id,
        name=name,
        labels={**record.labels, **labels},
        token_hash=_hash(secret),
        agent_version=agent_version,
        runtime=runtime,
        last_seen_at=datetime.now(UTC),
    )
    session.add(device)
    session.flush()
    return device, tenant, secret


def authenticate_device(session: Session, secret: str) -> tuple[Device, Tenant]:
    if not secret.startswith(DEVICE_PREFIX):
        raise AuthenticationError("invalid device credential")
    row = session.exec(select(Device, Tenant).join(Tenant).where(Device.token_hash == _hash(secret))).first()
    if row is None:
        raise AuthenticationError("invalid device credential")
    device, tenant = row
    if device.status != "active":
        raise AuthenticationError(f"device {device.id} is {device.status}")
    if not tenant.is_active:
        raise AuthenticationError("tenant is disabled")
    return device, tenant


def revoke_device(session: Session, tenant: Tenant, device_id: str) -> Device:
    device = session.exec(select(Device).where(Device.id == device_id, Device.tenant_id == tenant.id)).first()
    if device is None:
        raise ValidationError(f"no device {device_id!r} in tenant {tenant.name!r}", param="device")
    device.status = "revoked"
    session.add(device)
    return device


def _ts(unix: float) -> datetime:
    try:
        return datetime.fromtimestamp(unix, UTC)
    except (OverflowError, OSError, ValueError):
        return datetime.now(UTC)


def ingest(
    session: Session,
    device: Device,
    usage: list[UsageItem],
    events: list[EventItem],
    prices: PriceLookup | None = None,
) -> tuple[int, int]:
    """Store what is new, skip what the cloud already has. Returns ``(accepted, duplicates)``.

    Ids already present (a retried batch, or a request the cloud metered itself on escalation) are skipped,
    never overwritten; the caller commits, so a batch is stored whole or not at all. Usage goes to the ledger
    (``controlplane.billing.ledger.ingest_usage``), which rates each new record at its own time with ``prices``
    (the cloud's cached price book; without it the price book is read once for the batch) and counts its cost
    against the tenant's budget period of that time.
    """
    ids = [u.id for u in usage]
    if len(set(ids)) != len(ids):
        raise ValidationError("usage: record ids must be unique within a batch", param="usage")
    plans = load_plans(session, "edge") if usage else []
    records = [
        NewUsage(
            id=u.id,
            tenant_id=device.tenant_id,
            device_id=device.id,
            model=u.model,
            model_version=version_number(u.model_version),
            tier=u.tier,
            prompt_tokens=u.prompt_tokens,
            completion_tokens=u.completion_tokens,
            status=u.status if u.status != "degraded" else "ok",
            latency_ms=u.latency_ms,
            ttft_ms=u.ttft_ms,
            escalation_reason=u.escalation_reason,
            # The arm of the rollout governing the model, by the version that served it (for billing).
            rollout_arm=usage_arm(
                plans, model=u.model.removeprefix("tierline/"), tenant_id=device.tenant_id, version=u.model_version
            ),
            occurred_at=_ts(u.occurred_at),
        )
        for u in usage
    ]
    result = ingest_usage(session, records, prices)
    accepted, duplicates = result.accepted, result.duplicates
    eids = [e.id for e in events]
    seen = set(session.exec(select(DeviceEvent.id).where(col(DeviceEvent.id).in_(eids)))) if eids else set()
    for e in events:
        if e.id in seen:
            duplicates += 1
            continue
        seen.add(e.id)
        session.add(
            DeviceEvent(
                id=e.id,
                device_id=device.id,
                tenant_id=device.tenant_id,
                kind=e.kind,
                payload=e.payload,
                occurred_at=_ts(e.occurred_at),
            )
        )
        accepted += 1
    return accepted, duplicates
