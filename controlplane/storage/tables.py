"""SQLModel tables shared by the cloud tier and the console. Rows are "records"; money is Decimal.

Every timestamp column is ``UTCDateTime`` (stored UTC, read back timezone-aware). A usage record's cost is
``Micros`` (integer millionths), so sums of it are exact on SQLite too. Secrets (API keys, device tokens,
passwords) are stored only as hashes. Alembic migrations in ``controlplane/migrations`` create exactly this
schema (a test checks for drift).
"""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

from sqlalchemy import JSON, BigInteger, Column, Index, Numeric, Text, UniqueConstraint
from sqlmodel import Field, SQLModel

from controlplane.storage.types import Micros, UTCDateTime

MONEY = Numeric(18, 6)

# Named constraints, so migrations can alter them on PostgreSQL and in SQLite batch mode alike.
SQLModel.metadata.naming_convention = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


def utcnow() -> datetime:
    return datetime.now(UTC)


def _ts(nullable: bool = False, index: bool = False) -> Any:
    return Field(
        default_factory=utcnow if not nullable else None,
        sa_type=UTCDateTime,
        nullable=nullable,
        index=index,
    )


class Tenant(SQLModel, table=True):
    __tablename__ = "tenant"

    id: int | None = Field(default=None, primary_key=True)
    name: str = Field(max_length=64, unique=True, index=True)
    display_name: str = Field(default="", max_length=200)
    is_active: bool = True
    monthly_budget: Decimal | None = Field(default=None, sa_type=MONEY)
    currency: str = Field(default="USD", max_length=3)
    requests_per_minute: int | None = Field(default=None, description="None: the cloud's default")
    tokens_per_minute: int | None = None
    max_concurrent: int | None = None
    webhook_url: str | None = Field(
        default=None, max_length=2048, description="where tenant events (budget.threshold) are POSTed"
    )
    shadow_share: float | None = Field(
        default=None, description="share of its devices' edge answers shadowed by the cloud (None: the cloud's)"
    )
    created_at: datetime = _ts()


class ApiKey(SQLModel, table=True):
    __tablename__ = "api_key"

    id: int | None = Field(default=None, primary_key=True)
    tenant_id: int = Field(foreign_key="tenant.id", index=True)
    name: str = Field(default="", max_length=200)
    prefix: str = Field(max_length=16, description="first characters of the key, shown to identify it")
    key_hash: str = Field(max_length=128, unique=True, description="sha256 of the full key")
    allowed_models: list[str] | None = Field(default=None, sa_column=Column(JSON, nullable=True))
    requests_per_minute: int | None = Field(default=None, description="None: the cloud's default")
    tokens_per_minute: int | None = None
    max_concurrent: int | None = None
    project_id: int | None = Field(default=None, foreign_key="project.id", index=True)
    created_at: datetime = _ts()
    expires_at: datetime | None = Field(default=None, sa_type=UTCDateTime)
    revoked_at: datetime | None = Field(default=None, sa_type=UTCDateTime)
    last_used_at: datetime | None = Field(default=None, sa_type=UTCDateTime)


class ConsoleUser(SQLModel, table=True):
    __tablename__ = "console_user"

    id: int | None = Field(default=None, primary_key=True)
    username: str = Field(max_length=64, unique=True, index=True)
    password_hash: str = Field(max_length=255, description="argon2id")
    role: str = Field(default="viewer", max_length=16)
    created_at: datetime = _ts()
    last_login_at: datetime | None = Field(default=None, sa_type=UTCDateTime)


class Model(SQLModel, table=True):
    """A machine-learning model as the registry knows it (versions hold the artifacts)."""

    __tablename__ = "model"

    id: int | None = Field(default=None, primary_key=True)
    name: str = Field(max_length=128, unique=True, index=True)
    kind: str = Field(max_length=16, description="causal-lm | tensor")
    description: str = Field(default="", max_length=2000)
    created_at: datetime = _ts()
    # The cloud model this (edge) model escalates to (``tierline models pair``); None: it answers locally.
    cloud_model: str | None = Field(default=None, max_length=128)
    resend: str | None = Field(default=None, max_length=16, description="as-sent | text (with cloud_model)")


class ModelVersion(SQLModel, table=True):
    __tablename__ = "model_version"
    __table_args__ = (UniqueConstraint("model_id", "number"),)

    id: int | None = Field(default=None, primary_key=True)
    model_id: int = Field(foreign_key="model.id", index=True)
    number: int
    label: str | None = Field(default=None, max_length=64)
    source: str = Field(default="", max_length=500)
    status: str = Field(default="registered", max_length=16, description="registered|validated|active|retired")
    derived_from_id: int | None = Field(default=None, foreign_key="model_version.id")
    tags: list[str] = Field(default_factory=list, sa_column=Column(JSON, nullable=False))
    created_at: datetime = _ts()
    # An ``openai`` backend answers this version (shared.backend_spec.ServingSpec); None: the built-in engine.
    serving: dict[str, Any] | None = Field(default=None, sa_column=Column(JSON, nullable=True))


class ModelAlias(SQLModel, table=True):
    """A named pointer (``stable``, ``canary``, user-defined) to one version of a model; moved atomically."""

    __tablename__ = "model_alias"
    __table_args__ = (UniqueConstraint("model_id", "name"),)

    id: int | None = Field(default=None, primary_key=True)
    model_id: int = Field(foreign_key="model.id", index=True)
    name: str = Field(max_length=64)
    version_id: int = Field(foreign_key="model_version.id")
    updated_by: str = Field(default="", max_length=128)
    updated_at: datetime = _ts()


class ModelArtifact(SQLModel, table=True):
    __tablename__ = "model_artifact"

    id: int | None = Field(default=None, primary_key=True)
    version_id: int = Field(foreign_key="model_version.id", index=True)
    target: str = Field(max_length=8, description="cloud | edge")
    format: str = Field(max_length=32)
    sha256: str = Field(max_length=64, index=True)
    size: int
    uri: str = Field(max_length=1000)
    manifest: dict[str, Any] = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))
    status: str = Field(default="ready", max_length=16)
    created_at: datetime = _ts()


class UsageRecord(SQLModel, table=True):
    """One request's token usage. Immutable; keyed by request id so ingestion is idempotent."""

    __tablename__ = "usage_record"
    __table_args__ = (Index("ix_usage_record_tenant_time", "tenant_id", "occurred_at"),)

    id: str = Field(
        primary_key=True, max_length=64, description="the cloud's request id, or edge-... for a device's record"
    )
    tenant_id: int = Field(foreign_key="tenant.id")
    api_key_id: int | None = Field(default=None, foreign_key="api_key.id")
    device_id: str | None = Field(default=None, max_length=64)
    model: str = Field(max_length=128)
    model_version: int | None = None
    tier: str = Field(max_length=8, description="edge | cloud")
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0
    rows: int = Field(
        default=0,
        sa_column_kwargs={"server_default": "0"},  # writers that predate it (raw inserts, COPY) store 0
        description="input rows of a tensor-model call (0: an LLM request)",
    )
    status: str = Field(default="ok", max_length=16, description="ok | abandoned | error")
    latency_ms: float | None = None
    ttft_ms: float | None = None
    engine_ms: float | None = Field(
        default=None, description="the engine's own latency (hand-over to last token); latency_ms minus it: the API's"
    )
    rollout_arm: str | None = Field(default=None, max_length=16)
    escalation_reason: str | None = Field(default=None, max_length=32, description="why an edge request went up")
    price_id: int | None = Field(default=None, description="the price it was rated with; None: no price (flagged)")
    cost: Decimal | None = Field(
        default=None, sa_type=Micros, description="stored as integer micros, so sums of it are exact"
    )
    invoice_id: int | None = Field(
        default=None, foreign_key="invoice.id", index=True, description="the finalized invoice that billed it"
    )
    occurred_at: datetime = _ts()
    ingested_at: datetime = _ts()
    reported_at: datetime | None = Field(
        default=None,
        sa_type=UTCDateTime,
        description="the source's own time when it lay outside the accepted window (booked at occurred_at, clamped)",
    )
    usage_source: str | None = Field(
        default=None,
        max_length=16,
        description="who counted the tokens: None the engine or device; 'upstream' an upstream model server's "
        "usage; 'gateway' the gateway's tokenizer (the upstream sent no usage)",
    )


class Device(SQLModel, table=True):
    __tablename__ = "device"

    id: str = Field(primary_key=True, max_length=64)
    tenant_id: int = Field(foreign_key="tenant.id", index=True)
    labels: dict[str, str] = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))
    token_hash: str = Field(max_length=128, unique=True)
    agent_version: str = Field(default="", max_length=32)
    enrolled_at: datetime = _ts()
    last_seen_at: datetime | None = Field(default=None, sa_type=UTCDateTime)
    name: str = Field(default="", max_length=128)
    status: str = Field(default="active", max_length=16, description="active | revoked")
    runtime: dict[str, Any] = Field(
        default_factory=dict, sa_column=Column(JSON, nullable=False), description="host and runtime summary"
    )
    versions: dict[str, str] = Field(
        default_factory=dict, sa_column=Column(JSON, nullable=False), description="model -> loaded version"
    )
    metrics: dict[str, Any] = Field(
        default_factory=dict, sa_column=Column(JSON, nullable=False), description="last per-version metrics"
    )
    policies: dict[str, str] = Field(
        default_factory=dict,
        sa_column=Column(JSON, nullable=False),
        description="model -> escalation policy in use: a version number, 'override' or 'default'",
    )


class EnrollmentToken(SQLModel, table=True):
    """A one-time token an operator hands to a device; exchanged for the device's own credential."""

    __tablename__ = "enrollment_token"

    id: int | None = Field(default=None, primary_key=True)
    tenant_id: int = Field(foreign_key="tenant.id", index=True)
    token_hash: str = Field(max_length=128, unique=True, description="sha256 of the token")
    labels: dict[str, str] = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))
    created_at: datetime = _ts()
    expires_at: datetime = Field(sa_type=UTCDateTime)
    used_at: datetime | None = Field(default=None, sa_type=UTCDateTime)
    device_id: str | None = Field(default=None, max_length=64)


class DeviceEvent(SQLModel, table=True):
    """Telemetry and events a device delivered from its outbox, keyed by the device's record id."""

    __tablename__ = "device_event"

    id: str = Field(primary_key=True, max_length=64)
    device_id: str = Field(foreign_key="device.id", index=True)
    tenant_id: int = Field(foreign_key="tenant.id", index=True)
    kind: str = Field(max_length=16, description="telemetry | event")
    payload: dict[str, Any] = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))
    occurred_at: datetime = _ts()
    ingested_at: datetime = _ts()


class EscalationPolicy(SQLModel, table=True):
    """One version of an edge model's escalation policy: signal, threshold, the curve and the data it came from.

    Immutable; ``signature`` (Ed25519, the registry's signing key) covers ``model``, ``version``, ``target`` and
    ``policy`` (``controlplane.policies.service.signed_payload``), and devices verify it before use."""

    __tablename__ = "escalation_policy"
    __table_args__ = (UniqueConstraint("model", "version"),)

    id: int | None = Field(default=None, primary_key=True)
    model: str = Field(max_length=128, index=True, description="the edge model id, e.g. tierline/digits-small")
    version: int
    signal: str = Field(max_length=32)
    threshold: float
    max_quality_loss: float
    policy: dict[str, Any] = Field(
        default_factory=dict, sa_column=Column(JSON, nullable=False), description="the EdgePolicy JSON"
    )
    data_sha256: str = Field(max_length=64, description="digest of the validation set it was calibrated on")
    data_items: int
    target: list[dict[str, str]] = Field(
        default_factory=list, sa_column=Column(JSON, nullable=False), description="device selector terms"
    )
    derived_from: int | None = Field(default=None, description="the version whose curve it re-read, if any")
    signature: str = Field(max_length=128)
    key_id: str = Field(max_length=64)
    created_by: str = Field(max_length=128)
    created_at: datetime = _ts()


class ReleaseTarget(SQLModel, table=True):
    """Which devices a published edge release is for (no row: every device)."""

    __tablename__ = "release_target"
    __table_args__ = (UniqueConstraint("name", "version"),)

    id: int | None = Field(default=None, primary_key=True)
    name: str = Field(max_length=128)
    version: str = Field(max_length=128)
    target: list[dict[str, str]] = Field(default_factory=list, sa_column=Column(JSON, nullable=False))
    created_by: str = Field(max_length=128)
    created_at: datetime = _ts()


class AuditLog(SQLModel, table=True):
    """Who changed what, with the before and after."""

    __tablename__ = "audit_log"

    id: int | None = Field(default=None, primary_key=True)
    at: datetime = _ts(index=True)
    actor: str = Field(max_length=128)
    action: str = Field(max_length=64)
    target: str = Field(max_length=256)
    before: dict[str, Any] | None = Field(default=None, sa_column=Column(JSON, nullable=True))
    after: dict[str, Any] | None = Field(default=None, sa_column=Column(JSON, nullable=True))


class IdempotentResponse(SQLModel, table=True):
    """The stored answer to a request sent with an ``Idempotency-Key``; a retry gets it back, unbilled."""

    __tablename__ = "idempotent_response"

    tenant_id: int = Field(foreign_key="tenant.id", primary_key=True)
    key: str = Field(primary_key=True, max_length=255)
    request_hash: str = Field(max_length=64, description="sha256 of the request body")
    status: str = Field(default="in_progress", max_length=16, description="in_progress | done")
    response: dict[str, Any] | None = Field(default=None, sa_column=Column(JSON, nullable=True))
    created_at: datetime = _ts()
    claimed_at: datetime = _ts()
    claim_token: str = Field(
        default="", max_length=32, description="the claim's holder; a claim taken over after its lease cannot write"
    )


class Job(SQLModel, table=True):
    """An inference request accepted for later (``"async": true``), run by the cloud's job workers.

    ``available_at`` is when a worker may take the job: for a queued job, now or after a retry delay; for a
    running one, when its worker's lease lapses (a crashed worker's jobs are taken again then).
    """

    __tablename__ = "job"
    __table_args__ = (
        Index("ix_job_tenant_created", "tenant_id", "created_at"),
        Index("ix_job_status_available", "status", "available_at"),
    )

    id: str = Field(primary_key=True, max_length=64, description="also the request id of its usage record")
    tenant_id: int = Field(foreign_key="tenant.id")
    api_key_id: int | None = Field(default=None, foreign_key="api_key.id")
    endpoint: str = Field(max_length=32, description="/v1/chat/completions | /v1/completions | /v1/inference")
    model: str = Field(max_length=256)
    request: dict[str, Any] = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))
    status: str = Field(default="queued", max_length=16, description="queued | running | succeeded | failed")
    result: dict[str, Any] | None = Field(default=None, sa_column=Column(JSON, nullable=True))
    error: dict[str, Any] | None = Field(default=None, sa_column=Column(JSON, nullable=True))
    webhook_url: str | None = Field(default=None, max_length=2048)
    attempts: int = Field(default=0, description="how many times a worker started it")
    created_at: datetime = _ts()
    available_at: datetime = _ts()
    started_at: datetime | None = Field(default=None, sa_type=UTCDateTime)
    finished_at: datetime | None = Field(default=None, sa_type=UTCDateTime)


class WebhookSecret(SQLModel, table=True):
    """The key a tenant's webhooks are signed with (HMAC-SHA256). Kept readable, since signing needs it."""

    __tablename__ = "webhook_secret"

    tenant_id: int = Field(foreign_key="tenant.id", primary_key=True)
    secret: str = Field(max_length=128)
    created_at: datetime = _ts()


class WebhookDelivery(SQLModel, table=True):
    """One event on its way to a webhook URL: a job's result to the job's URL, or a tenant event (a budget
    threshold) to the tenant's URL. Its id is sent with every attempt.

    ``available_at`` is when the next attempt is due (and, while one is in flight, when its claim lapses).
    """

    __tablename__ = "webhook_delivery"
    __table_args__ = (Index("ix_webhook_delivery_status_available", "status", "available_at"),)

    id: str = Field(primary_key=True, max_length=64)
    job_id: str | None = Field(default=None, foreign_key="job.id", unique=True, description="None: a tenant event")
    tenant_id: int = Field(foreign_key="tenant.id", index=True)
    event: str = Field(default="job.completed", max_length=32, description="job.completed | budget.threshold")
    payload: dict[str, Any] | None = Field(
        default=None, sa_column=Column(JSON, nullable=True), description="the event's body (a job's is its JSON)"
    )
    url: str = Field(max_length=2048)
    status: str = Field(default="pending", max_length=16, description="pending | delivered | failed")
    attempts: int = 0
    created_at: datetime = _ts()
    available_at: datetime = _ts()
    finished_at: datetime | None = Field(default=None, sa_type=UTCDateTime)


class WebhookAttempt(SQLModel, table=True):
    """One POST of a webhook delivery: the receiver's status code, or why no answer came."""

    __tablename__ = "webhook_attempt"

    id: int | None = Field(default=None, primary_key=True)
    delivery_id: str = Field(foreign_key="webhook_delivery.id", index=True)
    attempt: int
    status_code: int | None = None
    error: str | None = Field(default=None, max_length=500)
    duration_ms: float | None = None
    at: datetime = _ts()


class Price(SQLModel, table=True):
    """A model's price per million tokens from ``effective_from`` on; rows are never rewritten (history)."""

    __tablename__ = "price"

    id: int | None = Field(default=None, primary_key=True)
    model: str = Field(max_length=128, index=True)
    version: int | None = Field(default=None, description="None: every version")
    tier: str | None = Field(default=None, max_length=8, description="edge | cloud | None: both")
    currency: str = Field(default="USD", max_length=3)
    prompt_per_mtok: Decimal = Field(sa_type=MONEY)
    completion_per_mtok: Decimal = Field(sa_type=MONEY)
    cached_per_mtok: Decimal = Field(sa_type=MONEY)
    per_call: Decimal = Field(default=Decimal(0), sa_type=MONEY, description="a fee per request (tensor calls too)")
    per_row: Decimal = Field(default=Decimal(0), sa_type=MONEY, description="a fee per input row of a tensor call")
    effective_from: datetime = Field(sa_type=UTCDateTime)
    created_at: datetime = _ts()
    plan_id: int | None = Field(default=None, foreign_key="price_plan.id", index=True, description="None: an override")
    tenant_id: int | None = Field(
        default=None, foreign_key="tenant.id", index=True, description="set: this tenant's own override of its plan"
    )


class PricePlan(SQLModel, table=True):
    """A named set of prices (``price.plan_id``); its versions are its prices' effective dates. Tenants are put on
    a plan from a moment on (``tenant_plan``); the one named ``default`` prices every tenant on no plan."""

    __tablename__ = "price_plan"

    id: int | None = Field(default=None, primary_key=True)
    name: str = Field(max_length=64, unique=True)
    description: str = Field(default="", max_length=500)
    created_at: datetime = _ts()


class TenantPlan(SQLModel, table=True):
    """A tenant on a plan from ``effective_from`` on: usage is rated with the plan in force at its own time."""

    __tablename__ = "tenant_plan"
    __table_args__ = (Index("ix_tenant_plan_tenant_from", "tenant_id", "effective_from"),)

    id: int | None = Field(default=None, primary_key=True)
    tenant_id: int = Field(foreign_key="tenant.id")
    plan_id: int = Field(foreign_key="price_plan.id")
    effective_from: datetime = Field(sa_type=UTCDateTime)
    created_at: datetime = _ts()
    created_by: str = Field(default="", max_length=128)


class BudgetPeriod(SQLModel, table=True):
    """A tenant's spend in one calendar month: settled cost plus what requests in flight have reserved.

    Reservations are one conditional UPDATE (``spent + reserved + amount <= budget``), atomic on SQLite and
    PostgreSQL alike, so concurrent requests can never commit more than the budget.
    """

    __tablename__ = "budget_period"

    tenant_id: int = Field(foreign_key="tenant.id", primary_key=True)
    period: str = Field(primary_key=True, max_length=7, description="YYYY-MM (UTC)")
    spent: Decimal = Field(default=Decimal(0), sa_type=MONEY)
    reserved: Decimal = Field(default=Decimal(0), sa_type=MONEY, description="sum of the period's open reservations")


class UsageCheckpoint(SQLModel, table=True):
    """A streamed request's usage so far, written before its tokens are sent (every ``checkpoint`` tokens or ms).

    Settled when the request ends: its final ``usage_record`` (same id) is inserted and this row deleted in one
    transaction. A row still here when its lease expires was left by a process that died mid-stream: the
    reconciler bills what it holds (status ``interrupted``) and releases the rest of its budget reservation.
    """

    __tablename__ = "usage_checkpoint"

    id: str = Field(primary_key=True, max_length=64, description="the usage record's id it settles into")
    tenant_id: int = Field(foreign_key="tenant.id")
    api_key_id: int | None = Field(default=None, foreign_key="api_key.id")
    device_id: str | None = Field(default=None, max_length=64)
    model: str = Field(max_length=128)
    model_version: int | None = None
    rollout_arm: str | None = Field(default=None, max_length=16)
    escalation_reason: str | None = Field(default=None, max_length=32)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0
    reservation_id: str | None = Field(default=None, max_length=32, description="its budget reservation, if any")
    period: str | None = Field(default=None, max_length=7, description="the period the reservation holds")
    reserved: Decimal | None = Field(default=None, sa_type=MONEY, description="the amount the reservation holds")
    started_at: datetime = _ts()
    updated_at: datetime = _ts()
    expires_at: datetime = _ts(index=True)


class BudgetReservation(SQLModel, table=True):
    """One request's hold on its tenant's budget, counted in ``BudgetPeriod.reserved`` until it is settled or,
    when the process holding it died, until its lease expires and the sweeper gives it back."""

    __tablename__ = "budget_reservation"

    id: str = Field(primary_key=True, max_length=32)
    tenant_id: int = Field(foreign_key="tenant.id", index=True)
    period: str = Field(max_length=7)
    amount: Decimal = Field(sa_type=MONEY)
    created_at: datetime = _ts()
    expires_at: datetime = _ts(index=True)
    windows: list[list[Any]] | None = Field(
        default=None,
        sa_column=Column(JSON, nullable=True),
        description="the scoped budget windows it holds too: [[budget id, subject, window], ...]",
    )
    on_credit: bool = Field(default=False, description="held on the tenant's prepaid credit, not its month")


class CreditAccount(SQLModel, table=True):
    """A tenant's prepaid credit: the balance (the sum of its ``credit_entry`` records, kept here so a request
    can hold on it with one conditional UPDATE) and what requests in flight hold of it."""

    __tablename__ = "credit_account"

    tenant_id: int = Field(foreign_key="tenant.id", primary_key=True)
    balance: Decimal = Field(default=Decimal(0), sa_type=Micros)
    reserved: Decimal = Field(default=Decimal(0), sa_type=Micros)
    low_balance: Decimal | None = Field(default=None, sa_type=Micros, description="alert below this balance")
    low_alerted_at: datetime | None = Field(
        default=None, sa_type=UTCDateTime, description="when the low-balance alert fired (None: not since a top-up)"
    )


class CreditEntry(SQLModel, table=True):
    """One movement of a tenant's prepaid credit, never edited: a top-up (+) or usage drawing it down (-)."""

    __tablename__ = "credit_entry"
    __table_args__ = (Index("ix_credit_entry_tenant_period", "tenant_id", "period"),)

    id: int | None = Field(default=None, primary_key=True)
    tenant_id: int = Field(foreign_key="tenant.id")
    kind: str = Field(max_length=8, description="top_up | draw")
    amount: Decimal = Field(sa_type=Micros, description="+ for a top-up, - for a draw")
    period: str = Field(max_length=7, description="YYYY-MM (UTC) of the usage drawn, or of the top-up")
    reference: str = Field(default="", max_length=128, description="the request or sync a draw paid for")
    note: str = Field(default="", max_length=500)
    created_by: str = Field(default="", max_length=128)
    created_at: datetime = _ts()


class Project(SQLModel, table=True):
    """A named group of a tenant's API keys, with budgets of its own."""

    __tablename__ = "project"
    __table_args__ = (UniqueConstraint("tenant_id", "name"),)

    id: int | None = Field(default=None, primary_key=True)
    tenant_id: int = Field(foreign_key="tenant.id", index=True)
    name: str = Field(max_length=64)
    created_at: datetime = _ts()


class Budget(SQLModel, table=True):
    """A spending limit on one scope of a tenant: the tenant, an API key, a project or an end user, per day,
    month (UTC) or in total. A hard one refuses requests it cannot cover; a soft one only counts and reports.

    ``ref`` names the scoped thing: the key's or project's id, the end user's id (``*``: every end user, each
    with a limit of their own), empty for the tenant.
    """

    __tablename__ = "budget"
    __table_args__ = (UniqueConstraint("tenant_id", "scope", "ref", "period"),)

    id: int | None = Field(default=None, primary_key=True)
    tenant_id: int = Field(foreign_key="tenant.id", index=True)
    scope: str = Field(max_length=8, description="tenant | key | project | user")
    ref: str = Field(default="", max_length=256)
    period: str = Field(max_length=8, description="day | month | total")
    amount: Decimal = Field(sa_type=Micros)
    is_hard: bool = True
    created_at: datetime = _ts()


class BudgetWindow(SQLModel, table=True):
    """A budget's settled spend and open reservations in one window (``YYYY-MM-DD``, ``YYYY-MM`` or ``total``),
    for one end user when the budget is every end user's (``subject``; empty otherwise)."""

    __tablename__ = "budget_window"

    budget_id: int = Field(foreign_key="budget.id", primary_key=True)
    subject: str = Field(default="", primary_key=True, max_length=256)
    window: str = Field(primary_key=True, max_length=10)
    spent: Decimal = Field(default=Decimal(0), sa_type=Micros)
    reserved: Decimal = Field(default=Decimal(0), sa_type=Micros)


class Rollout(SQLModel, table=True):
    """A canary rollout of a model's candidate version against its baseline, in steps of candidate weight.

    Versions are strings: edge artifact versions are names like ``tiny-2``, cloud versions are numbers.
    ``revision`` grows with every transition, so two controllers (or an operator and a controller) can never
    both apply a transition to the same state.
    """

    __tablename__ = "rollout"
    __table_args__ = (Index("ix_rollout_model_status", "model", "status"),)

    id: int | None = Field(default=None, primary_key=True)
    tenant_id: int | None = Field(default=None, foreign_key="tenant.id", description="None: every tenant")
    model: str = Field(max_length=128, description="cloud model name, or the edge artifact name")
    baseline_version: str = Field(max_length=64)
    candidate_version: str = Field(max_length=64)
    scope: str = Field(max_length=8, description="cloud | edge | both")
    device_selector: dict[str, str] = Field(
        default_factory=dict, sa_column=Column(JSON, nullable=False), description="labels a device must carry"
    )
    steps: list[float] = Field(default_factory=list, sa_column=Column(JSON, nullable=False))
    step_index: int = 0
    weight: float = Field(default=0.0, description="the candidate's share of subjects now, in percent")
    status: str = Field(
        default="pending", max_length=16, description="pending | running | paused | promoted | rolled_back | aborted"
    )
    min_step_s: float = Field(default=300.0, description="least time a step runs before it may advance")
    min_samples: int = Field(default=100, description="least requests per arm before a step is judged")
    checks: dict[str, Any] = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))
    last_analysis: dict[str, Any] | None = Field(default=None, sa_column=Column(JSON, nullable=True))
    created_by: str = Field(default="", max_length=128)
    revision: int = Field(default=1)
    created_at: datetime = _ts()
    updated_at: datetime = _ts()
    step_started_at: datetime | None = Field(default=None, sa_type=UTCDateTime)
    finished_at: datetime | None = Field(default=None, sa_type=UTCDateTime)
    shadow_sample: float = Field(
        default=0.0, description="percent of baseline cloud requests mirrored at step 0 (0: no shadow step)"
    )
    shadow_min_agreement: float = Field(default=0.9, description="least mean token agreement to leave the shadow step")
    kind: str = Field(
        default="model",
        max_length=8,
        sa_column_kwargs={"server_default": "model"},
        description="model: versions of a model; policy: versions of an edge model's escalation policy",
    )


class RolloutShadowSample(SQLModel, table=True):
    """One mirrored request of a rollout's shadow step: the candidate's greedy tokens against the baseline's."""

    __tablename__ = "rollout_shadow_sample"

    id: int | None = Field(default=None, primary_key=True)
    rollout_id: int = Field(foreign_key="rollout.id", index=True)
    at: datetime = _ts()
    positions: int = Field(description="tokens the baseline generated")
    matches: int = Field(description="positions where the candidate's token equals the baseline's")
    agreement: float = Field(description="matches / positions")


class RolloutEvent(SQLModel, table=True):
    """One transition of a rollout, with its reason and the metrics that caused it."""

    __tablename__ = "rollout_event"

    id: int | None = Field(default=None, primary_key=True)
    rollout_id: int = Field(foreign_key="rollout.id", index=True)
    at: datetime = _ts()
    kind: str = Field(max_length=32, description="created | started | advanced | paused | resumed | promoted | ...")
    from_status: str | None = Field(default=None, max_length=16)
    to_status: str = Field(max_length=16)
    step_index: int
    weight: float
    reason: str = Field(default="", max_length=2000)
    metrics: dict[str, Any] | None = Field(default=None, sa_column=Column(JSON, nullable=True))
    actor: str = Field(default="", max_length=128)


class RolloutPin(SQLModel, table=True):
    """A tenant or device held on one arm of a rollout, or left out of it."""

    __tablename__ = "rollout_pin"
    __table_args__ = (UniqueConstraint("rollout_id", "kind", "key"),)

    id: int | None = Field(default=None, primary_key=True)
    rollout_id: int = Field(foreign_key="rollout.id", index=True)
    kind: str = Field(max_length=8, description="tenant | device")
    key: str = Field(max_length=128, description="tenant name or device id")
    arm: str = Field(max_length=16, description="baseline | candidate | excluded")
    created_at: datetime = _ts()


class ConsoleToken(SQLModel, table=True):
    """A bearer token for the console's management API, acting as a console user. Only its sha256 is kept."""

    __tablename__ = "console_token"

    id: int | None = Field(default=None, primary_key=True)
    user_id: int = Field(foreign_key="console_user.id", index=True)
    name: str = Field(default="", max_length=200)
    prefix: str = Field(max_length=16, description="first characters of the token, shown to identify it")
    token_hash: str = Field(max_length=128, unique=True, description="sha256 of the token")
    created_at: datetime = _ts()
    revoked_at: datetime | None = Field(default=None, sa_type=UTCDateTime)
    last_used_at: datetime | None = Field(default=None, sa_type=UTCDateTime)


class Invoice(SQLModel, table=True):
    """A tenant's bill for one calendar month: ``draft`` (live), ``finalized`` (locked, lines hashed), ``void``.

    Finalizing stamps ``usage_record.invoice_id`` on every record it bills, so a record is billed exactly once:
    a late record of a closed month has no invoice id yet and lands on the next invoice as an adjustment line.
    """

    __tablename__ = "invoice"
    __table_args__ = (Index("ix_invoice_tenant_period", "tenant_id", "period"),)

    id: int | None = Field(default=None, primary_key=True)
    tenant_id: int = Field(foreign_key="tenant.id")
    period: str = Field(max_length=7, description="YYYY-MM (UTC)")
    number: str | None = Field(default=None, max_length=32, unique=True, description="assigned at finalize")
    status: str = Field(default="draft", max_length=16, description="draft | finalized | void")
    currency: str = Field(default="USD", max_length=3)
    subtotal: Decimal = Field(default=Decimal(0), sa_type=MONEY, description="usage lines of the period")
    adjustments: Decimal = Field(default=Decimal(0), sa_type=MONEY, description="late records of closed periods")
    credits: Decimal = Field(default=Decimal(0), sa_type=MONEY, description="credit notes issued against it")
    total: Decimal = Field(default=Decimal(0), sa_type=MONEY)
    lines_hash: str | None = Field(default=None, max_length=64, description="sha256 of the canonical lines")
    plan: str | None = Field(default=None, max_length=64, description="the price plan the tenant was on")
    credit_used: Decimal = Field(default=Decimal(0), sa_type=MONEY, description="prepaid credit drawn by its usage")
    created_at: datetime = _ts()
    finalized_at: datetime | None = Field(default=None, sa_type=UTCDateTime)
    voided_at: datetime | None = Field(default=None, sa_type=UTCDateTime)
    void_reason: str | None = Field(default=None, max_length=500)


class InvoiceLine(SQLModel, table=True):
    """One line of a finalized invoice: usage of one model/version/tier in one period, at its rated cost."""

    __tablename__ = "invoice_line"

    id: int | None = Field(default=None, primary_key=True)
    invoice_id: int = Field(foreign_key="invoice.id", index=True)
    kind: str = Field(max_length=16, description="usage | adjustment")
    usage_period: str = Field(max_length=7, description="the month the records occurred in")
    model: str = Field(max_length=128)
    model_version: int | None = None
    tier: str = Field(max_length=8)
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0
    unpriced_records: int = Field(default=0, description="records with no price in force (flagged, cost 0)")
    amount: Decimal = Field(default=Decimal(0), sa_type=MONEY)
    description: str = Field(default="", max_length=500)


class CreditNote(SQLModel, table=True):
    """A correction against a finalized invoice; the invoice itself never changes."""

    __tablename__ = "credit_note"

    id: int | None = Field(default=None, primary_key=True)
    invoice_id: int = Field(foreign_key="invoice.id", index=True)
    tenant_id: int = Field(foreign_key="tenant.id", index=True)
    number: str = Field(max_length=32, unique=True)
    amount: Decimal = Field(sa_type=MONEY)
    currency: str = Field(default="USD", max_length=3)
    reason: str = Field(max_length=1000)
    created_by: str = Field(default="", max_length=128)
    created_at: datetime = _ts()


class BudgetAlert(SQLModel, table=True):
    """A budget threshold (percent) a tenant crossed in a month; the unique key makes each fire once."""

    __tablename__ = "budget_alert"
    __table_args__ = (UniqueConstraint("tenant_id", "period", "threshold"),)

    id: int | None = Field(default=None, primary_key=True)
    tenant_id: int = Field(foreign_key="tenant.id", index=True)
    period: str = Field(max_length=7)
    threshold: int = Field(description="percent of the monthly budget: 80 or 100")
    spent: Decimal = Field(sa_type=MONEY)
    budget: Decimal = Field(sa_type=MONEY)
    fired_at: datetime = _ts()


class ConsoleSession(SQLModel, table=True):
    """A signed-in console session. Only the sha256 of its id is kept; the id itself travels in the signed cookie,
    so a session ends for every copy of the cookie the moment ``revoked_at`` is set."""

    __tablename__ = "console_session"

    id: int | None = Field(default=None, primary_key=True)
    session_hash: str = Field(max_length=64, unique=True, description="sha256 of the session id")
    user_id: int = Field(foreign_key="console_user.id", index=True)
    created_at: datetime = _ts()
    expires_at: datetime = _ts(index=True)
    last_seen_at: datetime = _ts()
    revoked_at: datetime | None = Field(default=None, sa_type=UTCDateTime)
    client: str = Field(default="", max_length=64, description="the address it signed in from")
    user_agent: str = Field(default="", max_length=200)


class ConsoleLoginAttempt(SQLModel, table=True):
    """Sign-in attempts of one username from one address in the current window, counted before the password is
    checked. The key is a hash, so a password typed into the username field is never stored."""

    __tablename__ = "console_login_attempt"

    key: str = Field(primary_key=True, max_length=64, description="sha256 of the lowercased username and address")
    attempts: int = 0
    window_start: datetime = _ts(index=True)


class EdgeRelease(SQLModel, table=True):
    """A published edge artifact version: its signed manifest (the files' bytes are blobs in the artifact store,
    named by their sha256). Immutable: a name and version is published with one manifest only."""

    __tablename__ = "edge_release"
    __table_args__ = (UniqueConstraint("name", "version"),)

    id: int | None = Field(default=None, primary_key=True)
    name: str = Field(max_length=128)
    version: str = Field(max_length=128)
    sha256: str = Field(max_length=64, description="the manifest's sha256")
    manifest: str = Field(sa_column=Column(Text, nullable=False), description="the signed manifest, as served")
    created_at: datetime = _ts()


class EdgePublish(SQLModel, table=True):
    """The publish log, oldest first: each device is told the most recently published version of each model."""

    __tablename__ = "edge_publish"

    id: int | None = Field(default=None, primary_key=True)
    name: str = Field(max_length=128, index=True)
    version: str = Field(max_length=128)
    published_at: datetime = _ts()


class ShadowSample(SQLModel, table=True):
    """One edge-answered input the cloud answered again in the background (the live quality monitor): whether
    the cloud's answer agreed with the edge's, and the edge's confidence (a recalibration reads it)."""

    __tablename__ = "shadow_sample"
    __table_args__ = (Index("ix_shadow_sample_group", "model", "policy_version", "device_group"),)

    id: int | None = Field(default=None, primary_key=True)
    usage_id: str = Field(max_length=64, index=True, description="the shadow usage record that billed its batch")
    tenant_id: int = Field(foreign_key="tenant.id")
    device_id: str = Field(max_length=64)
    model: str = Field(max_length=128, description="the edge model")
    policy_version: int = Field(description="the escalation policy version the device ran")
    device_group: str = Field(max_length=64, description="the device's group label ('' when it has none)")
    confidence: float = Field(description="the policy's signal on the edge's answer")
    agrees: bool = Field(description="the cloud's answer equals the edge's")
    token_agreement: float | None = Field(
        default=None, description="LM samples: the share of the edge's tokens the cloud chose too (None: a row)"
    )
    created_at: datetime = _ts()


class QualityAlert(SQLModel, table=True):
    """Agreement with the cloud fell below what a policy version's calibration promised, for one device group;
    with a recalibrated threshold proposed from the shadow samples, until an admin accepts or dismisses it."""

    __tablename__ = "quality_alert"

    id: int | None = Field(default=None, primary_key=True)
    model: str = Field(max_length=128, index=True)
    policy_version: int
    device_group: str = Field(max_length=64)
    num_samples: int
    num_agreements: int
    upper_bound: float = Field(description="one-sided upper confidence bound on the agreement (Wilson)")
    promised: float = Field(description="the agreement the calibration promised on edge-answered requests")
    status: str = Field(default="open", max_length=16, description="open | accepted | dismissed")
    proposed_threshold: float | None = None
    proposed_policy: dict[str, Any] | None = Field(
        default=None, sa_column=Column(JSON, nullable=True), description="the EdgePolicy JSON proposed"
    )
    accepted_version: int | None = Field(default=None, description="the policy version accepting it made")
    resolved_by: str | None = Field(default=None, max_length=128)
    created_at: datetime = _ts()
    resolved_at: datetime | None = _ts(nullable=True)


class UsageQuarantine(SQLModel, table=True):
    """A device's usage record beyond what the device could have done (more tokens than its model's context
    allows, or faster than its rate bound): kept for the operator (``tierline billing quarantined``), never billed
    and never counted against a budget. Keyed by the id the record would have had in ``usage_record``."""

    __tablename__ = "usage_quarantine"
    __table_args__ = (Index("ix_usage_quarantine_tenant_time", "tenant_id", "received_at"),)

    id: str = Field(primary_key=True, max_length=64, description="edge-...: the usage id it would have been billed as")
    tenant_id: int = Field(foreign_key="tenant.id")
    device_id: str = Field(max_length=64)
    model: str = Field(max_length=128)
    model_version: str | None = Field(default=None, max_length=64, description="as the device reported it")
    tier: str = Field(max_length=8)
    prompt_tokens: int = Field(sa_type=BigInteger)
    completion_tokens: int = Field(sa_type=BigInteger)
    status: str = Field(max_length=16)
    occurred_at: datetime = Field(sa_type=UTCDateTime, description="the device's own time for it")
    reason: str = Field(max_length=300, description="the bound it broke")
    received_at: datetime = _ts()
