"""Webhooks: URL rules, signing, retry delays, and the delivery records (``WebhookStore``).

Two kinds of event are delivered: a finished job (``job.completed``, to the job's ``webhook_url``) and
tenant events such as ``budget.threshold`` (to the tenant's webhook URL, ``PUT /v1/webhook``). Each delivery
POSTs the event's JSON (a job's is the job) with ``x-tierline-event`` (the event type),
``x-tierline-signature: sha256=<hex HMAC-SHA256 of the raw body, keyed with the tenant's webhook secret>``,
``x-tierline-delivery`` (the same id on every retry of one delivery) and ``x-tierline-timestamp`` (Unix
seconds of the attempt). A non-2xx answer, a timeout or a refused connection is retried after an
exponentially growing, jittered delay, up to a maximum number of
attempts; every attempt is recorded. The secret is kept readable (signing needs it) and never logged.

The address rules (``is_public_address``, numeric host forms) are ``shared.egress``'s, shared with the checks of
registry serving specs.
"""

from __future__ import annotations

import hashlib
import hmac
import random
import secrets
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any
from urllib.parse import urlsplit

from sqlalchemy import func, update
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from controlplane.storage.tables import Job, Tenant, WebhookAttempt, WebhookDelivery, WebhookSecret, utcnow
from controlplane.storage.types import as_utc
from shared.egress import is_private_literal, numeric_host_problem
from shared.egress import is_public_address as is_public_address  # the dispatcher's check of resolved addresses
from shared.errors import ValidationError

SIGNATURE_HEADER = "x-tierline-signature"
DELIVERY_HEADER = "x-tierline-delivery"
TIMESTAMP_HEADER = "x-tierline-timestamp"
EVENT_HEADER = "x-tierline-event"
JOB_COMPLETED = "job.completed"
SECRET_PREFIX = "whsec_"  # noqa: S105 (a prefix, not a secret)
MAX_URL_LENGTH = 2048
MAX_DELAY_S = 3600.0
PENDING, DELIVERED, FAILED = "pending", "delivered", "failed"


def new_secret() -> str:
    return SECRET_PREFIX + secrets.token_urlsafe(32)


def new_delivery_id() -> str:
    return f"whd_{uuid.uuid4().hex}"


def sign(secret: str, body: bytes) -> str:
    """The ``x-tierline-signature`` value for ``body``."""
    return "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


def is_valid_signature(secret: str, body: bytes, signature: str) -> bool:
    return hmac.compare_digest(sign(secret, body), signature)


def retry_delay(attempt: int, base_s: float, rng: random.Random | None = None) -> float:
    """Seconds to wait after failed attempt ``attempt`` (1-based): ``base * 2^(attempt-1)``, ±50% jitter, capped."""
    jitter = (rng or random).uniform(0.5, 1.5)
    return min(MAX_DELAY_S, base_s * 2 ** (attempt - 1)) * jitter


def validate_webhook_url(value: Any, *, allow_private: bool) -> str:
    """An http(s) URL with a host; a numeric host must be a dotted-decimal IPv4 address; with ``allow_private``
    off, a literal non-public address is refused here (host names are checked when delivering, after they
    resolve, and the delivery connects to the address that was checked)."""
    if not isinstance(value, str):
        raise ValidationError("webhook_url: must be a string", param="webhook_url")
    if len(value) > MAX_URL_LENGTH:
        raise ValidationError(f"webhook_url: at most {MAX_URL_LENGTH} characters", param="webhook_url")
    try:
        parts = urlsplit(value)
        host = parts.hostname
        _ = parts.port
    except ValueError as exc:
        raise ValidationError(f"webhook_url: not a valid URL ({exc})", param="webhook_url") from None
    if parts.scheme not in ("http", "https"):
        raise ValidationError("webhook_url: must be an http:// or https:// URL", param="webhook_url")
    if not host:
        raise ValidationError("webhook_url: has no host", param="webhook_url")
    if parts.username is not None or parts.password is not None:
        raise ValidationError("webhook_url: must not carry credentials", param="webhook_url")
    if "%" in host and ":" not in host:
        raise ValidationError(f"webhook_url: host {host!r} must not be percent-encoded", param="webhook_url")
    host = host.removesuffix(".")
    if (problem := numeric_host_problem(host)) is not None:
        raise ValidationError(f"webhook_url: {problem}", param="webhook_url")
    if not allow_private and is_private_literal(host):
        raise ValidationError("webhook_url: must be a public address", param="webhook_url")
    return value


def attempt_json(a: WebhookAttempt) -> dict[str, Any]:
    """One delivery attempt as the API shows it (a job's delivery log and the tenant's event log)."""
    return {
        "attempt": a.attempt,
        "status_code": a.status_code,
        "error": a.error,
        "duration_ms": a.duration_ms,
        "at": a.at.timestamp(),
    }


@dataclass(slots=True)
class ClaimedDelivery:
    """A delivery taken for one attempt, with what that attempt sends: the job, or a tenant event's payload."""

    id: str
    url: str
    attempt: int
    job: Job | None
    secret: str | None
    event: str = JOB_COMPLETED
    payload: dict[str, Any] | None = None


class WebhookStore:
    """Tenants' webhook secrets, and deliveries with their attempts. Synchronous (SQL)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def rotate_secret(self, tenant_id: int) -> WebhookSecret:
        """A new secret for the tenant (the first, or replacing the old one at once)."""
        with Session(self.engine, expire_on_commit=False) as session:
            row = session.get(WebhookSecret, tenant_id)
            if row is None:
                row = WebhookSecret(tenant_id=tenant_id, secret=new_secret())
            else:
                row.secret, row.created_at = new_secret(), utcnow()
            session.add(row)
            session.commit()
            return row

    def has_secret(self, tenant_id: int) -> bool:
        with Session(self.engine) as session:
            return session.get(WebhookSecret, tenant_id) is not None

    def tenant_url(self, tenant_id: int) -> str | None:
        with Session(self.engine) as session:
            tenant = session.get(Tenant, tenant_id)
            return tenant.webhook_url if tenant is not None else None

    def set_tenant_url(self, tenant_id: int, url: str | None) -> None:
        """Where the tenant's events are POSTed from now on (None: nowhere)."""
        with Session(self.engine) as session:
            session.execute(update(Tenant).where(col(Tenant.id) == tenant_id).values(webhook_url=url))
            session.commit()

    @staticmethod
    def enqueue_event(session: Session, tenant_id: int, url: str, event: str, payload: dict[str, Any]) -> str:
        """Queue a tenant event for delivery, in the caller's transaction; its delivery id."""
        delivery_id = new_delivery_id()
        session.add(
            WebhookDelivery(id=delivery_id, job_id=None, tenant_id=tenant_id, event=event, payload=payload, url=url)
        )
        return delivery_id

    def events(
        self, tenant_id: int, event: str | None, limit: int
    ) -> list[tuple[WebhookDelivery, list[WebhookAttempt]]]:
        """The tenant's latest event deliveries (not jobs'), newest first, each with its attempts."""
        with Session(self.engine) as session:
            stmt = select(WebhookDelivery).where(
                WebhookDelivery.tenant_id == tenant_id, col(WebhookDelivery.job_id).is_(None)
            )
            if event is not None:
                stmt = stmt.where(WebhookDelivery.event == event)
            deliveries = list(session.exec(stmt.order_by(col(WebhookDelivery.created_at).desc()).limit(limit)))
            attempts: dict[str, list[WebhookAttempt]] = {d.id: [] for d in deliveries}
            if deliveries:
                rows = session.exec(
                    select(WebhookAttempt)
                    .where(col(WebhookAttempt.delivery_id).in_(list(attempts)))
                    .order_by(col(WebhookAttempt.attempt), col(WebhookAttempt.id))
                )
                for row in rows:
                    attempts[row.delivery_id].append(row)
            session.expunge_all()
            return [(d, attempts[d.id]) for d in deliveries]

    def due(self, limit: int) -> list[tuple[str, int]]:
        """``(delivery id, attempts so far)`` of pending deliveries whose next attempt is due."""
        with Session(self.engine) as session:
            stmt = (
                select(WebhookDelivery.id, WebhookDelivery.attempts)
                .where(WebhookDelivery.status == PENDING, col(WebhookDelivery.available_at) <= utcnow())
                .order_by(col(WebhookDelivery.available_at))
                .limit(limit)
            )
            return [(d, n) for d, n in session.exec(stmt).all()]

    def next_due(self) -> datetime | None:
        """When the earliest pending delivery's next attempt falls due (now or past included)."""
        with Session(self.engine) as session:
            due = session.exec(
                select(func.min(WebhookDelivery.available_at)).where(WebhookDelivery.status == PENDING)
            ).one()
            return as_utc(due) if due is not None else None

    def claim(self, delivery_id: str, attempts: int, hold_s: float) -> ClaimedDelivery | None:
        """Take the delivery for its next attempt: its due time moves ``hold_s`` ahead, so no other worker
        takes it meanwhile, and a worker that dies mid-attempt leaves it to be retried then."""
        now = utcnow()
        with Session(self.engine) as session:
            taken = session.exec(
                update(WebhookDelivery)
                .where(
                    col(WebhookDelivery.id) == delivery_id,
                    col(WebhookDelivery.attempts) == attempts,
                    col(WebhookDelivery.status) == PENDING,
                    col(WebhookDelivery.available_at) <= now,
                )
                .values(available_at=now + timedelta(seconds=hold_s))
            )
            session.commit()
            if taken.rowcount != 1:
                return None
            delivery = session.get(WebhookDelivery, delivery_id)
            if delivery is None:
                return None
            job = session.get(Job, delivery.job_id) if delivery.job_id is not None else None
            if delivery.job_id is not None:
                if job is None:
                    return None
                session.expunge(job)
            secret = session.get(WebhookSecret, delivery.tenant_id)
            return ClaimedDelivery(
                delivery.id,
                delivery.url,
                attempts + 1,
                job,
                secret.secret if secret else None,
                delivery.event,
                delivery.payload,
            )

    def record(
        self,
        claimed: ClaimedDelivery,
        *,
        status_code: int | None,
        error: str | None,
        duration_ms: float | None,
        retry_in_s: float | None,
    ) -> None:
        """Log the attempt and move the delivery on: delivered (2xx), retried in ``retry_in_s``, or failed."""
        now = utcnow()
        is_ok = status_code is not None and 200 <= status_code < 300
        if is_ok:
            values: dict[str, Any] = {"status": DELIVERED, "finished_at": now}
        elif retry_in_s is None:
            values = {"status": FAILED, "finished_at": now}
        else:
            values = {"available_at": now + timedelta(seconds=retry_in_s)}
        with Session(self.engine) as session:
            session.add(
                WebhookAttempt(
                    delivery_id=claimed.id,
                    attempt=claimed.attempt,
                    status_code=status_code,
                    error=error[:500] if error else None,
                    duration_ms=duration_ms,
                    at=now,
                )
            )
            session.exec(
                update(WebhookDelivery)
                .where(col(WebhookDelivery.id) == claimed.id, col(WebhookDelivery.attempts) == claimed.attempt - 1)
                .values(attempts=claimed.attempt, **values)
            )
            session.commit()

    def for_job(self, job_id: str) -> tuple[WebhookDelivery | None, list[WebhookAttempt]]:
        with Session(self.engine) as session:
            delivery = session.exec(select(WebhookDelivery).where(WebhookDelivery.job_id == job_id)).first()
            if delivery is None:
                return None, []
            attempts = list(
                session.exec(
                    select(WebhookAttempt)
                    .where(WebhookAttempt.delivery_id == delivery.id)
                    .order_by(col(WebhookAttempt.attempt), col(WebhookAttempt.id))
                )
            )
            session.expunge_all()
            return delivery, attempts
