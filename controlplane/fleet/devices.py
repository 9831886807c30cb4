"""Devices: one-time enrollment tokens, device credentials, and idempotent ingestion of what devices report.

Tokens and credentials are random secrets shown once; only their sha256 is stored. Every query is scoped by
the device's tenant.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import update
from sqlmodel import Session, col, select

from controlplane.billing.ledger import NewUsage, ingest_usage
from controlplane.billing.pricing import PriceLookup
from controlplane.billing.scopes import ATTRIBUTION_LABELS, attribution_of, check_attribution
from controlplane.rollouts.metrics import POLICIES_KEY
from controlplane.rollouts.service import load_plans, usage_arm
from controlplane.storage.tables import Device, DeviceEvent, EnrollmentToken, Tenant
from controlplane.storage.types import as_utc
from shared.edge_protocol import EventItem, UsageItem, version_number
from shared.errors import AuthenticationError, ValidationError

logger = logging.getLogger(__name__)

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
    check_attribution(session, tenant.id, labels or {})  # billing.* labels name the tenant's own key/project
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
    claimed_labels = sorted(set(labels) & set(ATTRIBUTION_LABELS))
    if claimed_labels:  # whose budgets a device counts against is the operator's choice (the token's labels)
        raise ValidationError(
            f"labels: {', '.join(claimed_labels)} can only be given by the enrollment token", param="labels"
        )
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


# The latest representable instant; a device's float beyond it (or NaN) is read as "far future".
_MAX_UNIX = datetime(9999, 12, 31, tzinfo=UTC).timestamp()
_USAGE_ID_LEN = 64  # usage_record.id


@dataclass(frozen=True, slots=True)
class UsageWindow:
    """When a device's usage may have occurred; a record outside it is booked at the nearest edge and flagged.

    Attributes:
        max_future: how far ahead of the cloud's clock a device's clock may run.
        max_age: how old a record may be when it is synced (an outbox kept offline longer is booked at the edge).
        enrollment_margin: how long before its enrollment a device may date a record (clock skew at enroll).
    """

    max_future: timedelta = timedelta(minutes=5)
    max_age: timedelta = timedelta(days=35)
    enrollment_margin: timedelta = timedelta(hours=1)

    def clamp(self, reported: datetime, enrolled_at: datetime, now: datetime) -> datetime:
        earliest = max(as_utc(enrolled_at) - self.enrollment_margin, now - self.max_age)
        return min(max(reported, earliest), now + self.max_future)


@dataclass(frozen=True, slots=True)
class SyncCounts:
    accepted: int
    duplicates: int
    conflicts: int = 0
    clamped: int = 0


def device_usage_id(tenant_id: int, device_id: str, item_id: str) -> str:
    """The stored id of a device's usage record: namespaced by tenant and device, so a device can neither take
    an id the cloud meters under (its own ids never start ``edge-``) nor one of another device or tenant."""
    digest = hashlib.sha256(f"{tenant_id}:{device_id}:{item_id}".encode()).hexdigest()
    readable = f"edge-{tenant_id}-{device_id}-"
    if len(readable) + 24 > _USAGE_ID_LEN:  # an unusually long device id: the hash alone still namespaces it
        readable = "edge-"
    return readable + digest[: _USAGE_ID_LEN - len(readable)]


def _ts(unix: float) -> datetime:
    if not unix <= _MAX_UNIX:
        unix = _MAX_UNIX
    return datetime.fromtimestamp(max(unix, 0.0), UTC)


def ingest(
    session: Session,
    device: Device,
    usage: list[UsageItem],
    events: list[EventItem],
    prices: PriceLookup | None = None,
    window: UsageWindow | None = None,
    policies: dict[str, str] | None = None,
) -> SyncCounts:
    """Store what is new, skip what the cloud already has; count what conflicts and what was clamped.

    Usage is stored under ``device_usage_id`` (the device's tenant, the device and its own id). The same record
    again (a retried batch) is a duplicate; the same id with another payload is a conflict, not stored. A record
    dated outside ``window`` is booked at the window's edge with the device's time kept in ``reported_at``.
    The caller commits, so a batch is stored whole or not at all. Usage goes to the ledger
    (``controlplane.billing.ledger.ingest_usage``), which rates each new record at its own time with ``prices``
    (the cloud's cached price book; without it the price book is read once for the batch) and counts its cost
    against the tenant's budget period of that time and the budgets of the device's attribution (its
    enrollment token's ``billing.*`` labels: an API key, a project, an end user).

    ``policies`` (the escalation policies the sync reports in use) is stored with each telemetry sample of the
    batch, so a policy rollout knows which version served the requests the sample counts.
    """
    ids = [u.id for u in usage]
    if len(set(ids)) != len(ids):
        raise ValidationError("usage: record ids must be unique within a batch", param="usage")
    window = window or UsageWindow()
    now = datetime.now(UTC)
    plans = load_plans(session, "edge") if usage else []
    attribution = attribution_of(session, device) if usage else None
    records = []
    for u in usage:
        reported = _ts(u.occurred_at)
        booked = window.clamp(reported, device.enrolled_at, now)
        records.append(
            NewUsage(
                id=device_usage_id(device.tenant_id, device.id, u.id),
                tenant_id=device.tenant_id,
                api_key_id=attribution.key_id if attribution is not None else None,
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
                subject=u.subject,
                # The arm of the rollout governing the model, by the version that served it (for billing).
                rollout_arm=usage_arm(
                    plans, model=u.model.removeprefix("tierline/"), tenant_id=device.tenant_id, version=u.model_version
                ),
                occurred_at=booked,
                reported_at=reported if booked != reported else None,
            )
        )
    result = ingest_usage(session, records, prices, attribution=attribution)
    clamped = sum(1 for r in records if r.reported_at is not None and r.id in result.accepted_ids)
    if clamped:
        logger.warning(
            "device %s: %d usage record(s) dated outside the accepted window were clamped", device.id, clamped
        )
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
                payload={**e.payload, POLICIES_KEY: dict(policies)}
                if policies is not None and e.kind == "telemetry"
                else e.payload,
                occurred_at=min(_ts(e.occurred_at), now + window.max_future),
            )
        )
        accepted += 1
    return SyncCounts(accepted, duplicates, result.conflicts, clamped)
