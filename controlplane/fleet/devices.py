"""Devices: one-time enrollment tokens, device credentials, and idempotent ingestion of what devices report.

Tokens and credentials are random secrets shown once; only their sha256 is stored. Every query is scoped by
the device's tenant.

A device's usage is bounded by what the device could have done (``UsageBounds``), before anything is billed:

- per record, by its model's context length ``C`` (the registry's artifact metadata: ``max_position_embeddings``,
  ``max_model_len``, ``context_length`` or ``n_ctx``; the cloud's known contexts; else ``default_context``), with
  ``S`` sequences at most (``max_sequences``: the prompts and choices one request may hold): prompt tokens, and
  completion tokens, and their sum, each at most ``C x S``; completion tokens at most the model's ``max_tokens``
  cap x ``S`` where its metadata names one. A tensor model's record counts input rows: at most ``MAX_ROWS``.
  Whatever the bounds, no count above ``MAX_LEDGER_TOKENS`` (what the ledger's columns hold) is billed.
- per device, by a rate: the tokens of the batch's new records at most ``max_tokens_per_s`` x the seconds since
  the device's previous sync (or its enrollment), plus ``burst_tokens``; records past that, in the batch's order,
  are out of bounds.

A record out of bounds is **quarantined**: stored in ``usage_quarantine`` under the id it would have been billed
as (with the bound it broke), never billed, never counted against a budget, counted in the sync answer
(``quarantined``), and listed by ``tierline billing quarantined``. The verdict is kept: a retried batch finds the
record quarantined (or billed) already and changes nothing.
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
from sqlalchemy.dialects import postgresql, sqlite
from sqlmodel import Session, col, select

from controlplane.billing.ledger import NewUsage, ingest_usage
from controlplane.billing.pricing import PriceLookup
from controlplane.billing.scopes import ATTRIBUTION_LABELS, attribution_of, check_attribution, device_end_user
from controlplane.rollouts.metrics import POLICIES_KEY
from controlplane.rollouts.service import load_plans, usage_arm
from controlplane.storage.audit import audit
from controlplane.storage.tables import (
    Device,
    DeviceEvent,
    EnrollmentToken,
    Model,
    ModelArtifact,
    ModelVersion,
    Tenant,
    UsageQuarantine,
    UsageRecord,
)
from controlplane.storage.types import as_utc
from shared.edge_protocol import EventItem, UsageItem, version_number
from shared.errors import AuthenticationError, ValidationError
from shared.tensor_rows import MAX_ROWS

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
    # The enrollment is a change of the fleet: audited in its transaction, by the token that allowed it.
    after = {"tenant": tenant.name, "name": name, "labels": device.labels, "agent_version": agent_version}
    audit(session, f"enrollment_token:{record.id}", "device.enroll", f"device/{device_id}", None, after)
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


# Where a model's artifact metadata states its context length, and its cap on generated tokens.
MAX_LEDGER_TOKENS = 2**31 - 1  # usage_record's integer token columns: whatever the bounds, never more
CONTEXT_KEYS = ("max_position_embeddings", "max_model_len", "context_length", "n_ctx")
MAX_TOKENS_KEYS = ("max_tokens", "max_new_tokens")


@dataclass(frozen=True, slots=True)
class ModelLimits:
    """What one request on a model can hold: its context length and its cap on generated tokens (None: none)."""

    context: int
    max_tokens: int | None = None
    is_tensor: bool = False


@dataclass(frozen=True, slots=True)
class UsageBounds:
    """What a device's usage records may claim (see the module docstring); beyond it they are quarantined.

    Attributes:
        default_context: the context length assumed for a model neither the registry nor ``contexts`` knows.
        max_sequences: the prompts x choices one request (one record) may hold.
        max_tokens_per_s: the device's rate bound: tokens per second of wall time since its previous sync.
        burst_tokens: tokens a sync may carry on top of the rate (a device's first sync, a short interval).
        contexts: context lengths the cloud knows by model name (its served models, the zoo's), after the registry.
    """

    default_context: int = 131_072
    max_sequences: int = 8
    max_tokens_per_s: float = 100_000.0
    burst_tokens: int = 4_000_000
    contexts: dict[str, int] | None = None

    def judge(self, item: UsageItem, limits: ModelLimits) -> str | None:
        """Why one record is beyond what its model allows (None: within)."""
        if max(item.prompt_tokens, item.completion_tokens) > MAX_LEDGER_TOKENS:
            return f"a token count above {MAX_LEDGER_TOKENS}, what the ledger holds"
        if limits.is_tensor:
            if item.prompt_tokens > MAX_ROWS or item.completion_tokens > MAX_ROWS:
                return f"more than {MAX_ROWS} rows in one tensor-model request"
            return None
        most = limits.context * self.max_sequences
        if item.prompt_tokens > most:
            return (
                f"{item.prompt_tokens} prompt tokens exceed {self.max_sequences} x the model's context "
                f"({limits.context})"
            )
        if item.completion_tokens > most:
            return (
                f"{item.completion_tokens} completion tokens exceed {self.max_sequences} x the model's context "
                f"({limits.context})"
            )
        if item.prompt_tokens + item.completion_tokens > most:
            return f"prompt and completion tokens exceed {self.max_sequences} x the model's context ({limits.context})"
        if limits.max_tokens is not None and item.completion_tokens > limits.max_tokens * self.max_sequences:
            return (
                f"{item.completion_tokens} completion tokens exceed {self.max_sequences} x the model's max_tokens "
                f"cap ({limits.max_tokens})"
            )
        return None

    def allowance(self, since: datetime | None, now: datetime) -> float:
        """The tokens a sync at ``now`` may carry when the device last synced (or enrolled) at ``since``."""
        elapsed = max(0.0, (now - as_utc(since)).total_seconds()) if since is not None else 0.0
        return self.max_tokens_per_s * elapsed + self.burst_tokens


def _positive_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def model_limits(session: Session, model: str, bounds: UsageBounds) -> ModelLimits:
    """A model's limits: from the registry (its kind, its artifacts' metadata: the largest context any version
    states), else from the cloud's known contexts, else ``bounds.default_context``."""
    names = {model, model.removeprefix("tierline/")}
    rows = session.exec(
        select(Model.kind, ModelArtifact.manifest)
        .join(ModelVersion, col(ModelVersion.model_id) == col(Model.id), isouter=True)
        .join(ModelArtifact, col(ModelArtifact.version_id) == col(ModelVersion.id), isouter=True)
        .where(col(Model.name).in_(sorted(names)))
    ).all()
    contexts: list[int] = []
    caps: list[int] = []
    is_tensor = False
    for kind, manifest in rows:
        is_tensor = is_tensor or kind == "tensor"
        metadata = (manifest or {}).get("metadata") or {}
        contexts += [c for c in (_positive_int(metadata.get(k)) for k in CONTEXT_KEYS) if c is not None]
        caps += [c for c in (_positive_int(metadata.get(k)) for k in MAX_TOKENS_KEYS) if c is not None]
    known = bounds.contexts or {}
    context = max(contexts) if contexts else next((known[n] for n in sorted(names) if n in known), None)
    return ModelLimits(context or bounds.default_context, max(caps) if caps else None, is_tensor)


@dataclass(frozen=True, slots=True)
class SyncCounts:
    accepted: int
    duplicates: int
    conflicts: int = 0
    clamped: int = 0
    quarantined: int = 0
    quarantined_ids: tuple[str, ...] = ()  # the records first quarantined by this sync (for the operator's alert)


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
    bounds: UsageBounds | None = None,
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

    A record beyond ``bounds`` (``UsageBounds``: its model's context, the device's rate) is quarantined instead
    of billed (see the module docstring).
    """
    ids = [u.id for u in usage]
    if len(set(ids)) != len(ids):
        raise ValidationError("usage: record ids must be unique within a batch", param="usage")
    window = window or UsageWindow()
    now = datetime.now(UTC)
    usage, num_quarantined, first_quarantined = _quarantine(session, device, usage, bounds or UsageBounds(), now)
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
                subject=device_end_user(attribution, u.subject).subject,  # its own unless allowed to name others
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
    return SyncCounts(accepted, duplicates, result.conflicts, clamped, num_quarantined, first_quarantined)


def _quarantine(
    session: Session, device: Device, usage: list[UsageItem], bounds: UsageBounds, now: datetime
) -> tuple[list[UsageItem], int, tuple[str, ...]]:
    """Split a batch into the records to bill and those beyond ``bounds``, storing the latter in
    ``usage_quarantine`` (the caller commits). Returns the records to bill, how many of the batch are in
    quarantine (this sync's and a retried batch's earlier verdicts) and the ids this call quarantined."""
    if not usage:
        return usage, 0, ()
    stored_id = {u.id: device_usage_id(device.tenant_id, device.id, u.id) for u in usage}
    ids = list(stored_id.values())
    held = set(session.exec(select(UsageQuarantine.id).where(col(UsageQuarantine.id).in_(ids))))
    billed = set(session.exec(select(UsageRecord.id).where(col(UsageRecord.id).in_(ids))))
    limits: dict[str, ModelLimits] = {}
    left = bounds.allowance(device.last_seen_at or device.enrolled_at, now)
    keep: list[UsageItem] = []
    out: list[tuple[UsageItem, str]] = []
    num_held = 0
    for u in usage:
        if stored_id[u.id] in held:  # a retry of a record quarantined before: the verdict stands
            num_held += 1
            continue
        if stored_id[u.id] in billed:  # a retry of a billed record: the ledger finds it a duplicate
            keep.append(u)
            continue
        if u.model not in limits:
            limits[u.model] = model_limits(session, u.model, bounds)
        reason = bounds.judge(u, limits[u.model])
        tokens = u.prompt_tokens + u.completion_tokens
        if reason is None and tokens > left:
            reason = f"past the device's rate bound ({bounds.max_tokens_per_s:g} tokens/s since its previous sync)"
        if reason is None:
            left -= tokens
            keep.append(u)
        else:
            out.append((u, reason))
    if not out:
        return keep, num_held, ()
    rows = [
        {
            "id": stored_id[u.id],
            "tenant_id": device.tenant_id,
            "device_id": device.id,
            "model": u.model,
            "model_version": u.model_version,
            "tier": u.tier,
            "prompt_tokens": u.prompt_tokens,
            "completion_tokens": u.completion_tokens,
            "status": u.status,
            "occurred_at": _ts(u.occurred_at),
            "reason": reason[:300],
            "received_at": now,
        }
        for u, reason in out
    ]
    table = UsageQuarantine.__table__  # type: ignore[attr-defined]
    connection = session.connection()
    insert = postgresql.insert(table) if connection.dialect.name == "postgresql" else sqlite.insert(table)
    inserted = tuple(r[0] for r in connection.execute(insert.on_conflict_do_nothing().returning(table.c.id), rows))
    logger.warning(
        "device %s: %d usage record(s) beyond what it could have done were quarantined, not billed: %s",
        device.id,
        len(out),
        "; ".join(f"{u.id} ({reason})" for u, reason in out[:5]),
    )
    return keep, num_held + len(out), inserted


def quarantined(session: Session, tenant_id: int | None = None, limit: int = 100) -> list[UsageQuarantine]:
    """The quarantined usage records, newest first (of one tenant, or of all)."""
    query = select(UsageQuarantine)
    if tenant_id is not None:
        query = query.where(col(UsageQuarantine.tenant_id) == tenant_id)
    return list(session.exec(query.order_by(col(UsageQuarantine.received_at).desc()).limit(limit)))
