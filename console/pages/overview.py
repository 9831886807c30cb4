"""Overview: live traffic over the last window, from usage records; the numbers refresh through HTMX polling."""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from litestar import Request, get
from litestar.response import Template
from sqlalchemy import Integer, case, cast, func
from sqlalchemy.engine import Engine
from sqlalchemy.sql.elements import ColumnElement
from sqlmodel import Session, col, select

from console.pages.charts import stacked_columns
from console.pages.common import render
from console.pages.quality import open_alerts
from controlplane.storage.tables import ApiKey, Device, Model, Rollout, Tenant, UsageRecord
from controlplane.tenancy import service as tenancy

WINDOWS_MIN = (5, 15, 60, 1440)


@dataclass(frozen=True, slots=True)
class TierTraffic:
    tier: str
    requests: int
    errors: int
    tokens: int
    p95_latency_ms: float | None


ANSWER_TIERS = ("edge", "cloud")  # the tiers that answer users; "shadow" rows are replays for the quality monitor


@dataclass(frozen=True, slots=True)
class Traffic:
    """What served requests looked like in ``[since, until)``."""

    window_s: float
    tiers: list[TierTraffic]
    # The seconds the rates are measured over: from the window's first request (or its start, when requests came
    # from before it) to its end. Traffic that began a minute ago is not averaged over the quiet minutes before.
    measured_s: float = 0.0

    @property
    def requests(self) -> int:
        """Requests users sent (edge and cloud answers); shadow replays are the quality monitor's, not traffic."""
        return sum(t.requests for t in self.tiers if t.tier in ANSWER_TIERS)

    @property
    def requests_per_s(self) -> float:
        return self.requests / self.measured_s if self.measured_s > 0 else 0.0

    @property
    def tokens_per_s(self) -> float:
        tokens = sum(t.tokens for t in self.tiers if t.tier in ANSWER_TIERS)
        return tokens / self.measured_s if self.measured_s > 0 else 0.0

    @property
    def measured(self) -> str:
        """The span the rates are over, for a person: "4m 10s"."""
        minutes, seconds = divmod(round(self.measured_s), 60)
        return f"{minutes}m {seconds:02d}s" if minutes else f"{seconds}s"

    @property
    def edge_share(self) -> float | None:
        edge = sum(t.requests for t in self.tiers if t.tier == "edge")
        return edge / self.requests if self.requests else None

    @property
    def error_rate(self) -> float | None:
        return sum(t.errors for t in self.tiers if t.tier in ANSWER_TIERS) / self.requests if self.requests else None


def traffic(session: Session, since: datetime, until: datetime, tenant_id: int | None = None) -> Traffic:
    """Requests, tokens, errors and p95 latency per tier in ``[since, until)``, of one tenant or of all."""
    in_window: tuple[ColumnElement[bool], ...] = (
        col(UsageRecord.occurred_at) >= since,
        col(UsageRecord.occurred_at) < until,
    )
    if tenant_id is not None:
        in_window = (*in_window, col(UsageRecord.tenant_id) == tenant_id)
    rows = session.exec(
        select(  # type: ignore[call-overload]
            col(UsageRecord.tier),
            func.count(),
            func.sum(case((col(UsageRecord.status) == "error", 1), else_=0)),
            func.sum(col(UsageRecord.prompt_tokens) + col(UsageRecord.completion_tokens)),
            func.count(col(UsageRecord.latency_ms)),
            func.min(col(UsageRecord.occurred_at)),
        )
        .where(*in_window)
        .group_by(UsageRecord.tier)
        .order_by(UsageRecord.tier)
    ).all()
    tiers = []
    first: datetime | None = None
    for tier, n, errors, tokens, num_latency, earliest in rows:
        earliest = _aware(earliest)
        first = earliest if first is None or (earliest is not None and earliest < first) else first
        p95 = None
        if num_latency:
            rank = math.ceil(0.95 * int(num_latency))
            p95 = session.exec(
                select(UsageRecord.latency_ms)
                .where(*in_window, UsageRecord.tier == tier, col(UsageRecord.latency_ms).is_not(None))
                .order_by(col(UsageRecord.latency_ms))
                .offset(rank - 1)
                .limit(1)
            ).first()
        tiers.append(TierTraffic(tier, int(n), int(errors or 0), int(tokens or 0), p95))
    window_s = (until - since).total_seconds()
    # A window's first request starts the span; at least a minute, so one request a second ago is not "1/s".
    measured = window_s if first is None else min(window_s, max(60.0, (until - max(first, since)).total_seconds()))
    return Traffic(window_s, tiers, measured)


def _aware(ts: datetime | str | None) -> datetime | None:
    """A timestamp as the database returned it (SQLite's aggregate gives text) as an aware UTC datetime."""
    if ts is None:
        return None
    if isinstance(ts, str):
        ts = datetime.fromisoformat(ts)
    return ts if ts.tzinfo is not None else ts.replace(tzinfo=UTC)


def _bucket_of(session: Session, since: datetime, bucket_s: float) -> ColumnElement[Any]:
    """Which ``bucket_s``-second bucket after ``since`` a record's time falls in, computed by the database."""
    occurred = col(UsageRecord.occurred_at)
    if session.get_bind().dialect.name == "postgresql":
        return func.floor(func.extract("epoch", occurred - since) / bucket_s)
    # SQLite keeps UTC timestamps as text; julianday() reads them (and the naive UTC ``since``) as days.
    start = since.astimezone(UTC).replace(tzinfo=None).isoformat(sep=" ")
    return cast((func.julianday(occurred) - func.julianday(start)) * 86400.0 / bucket_s, Integer)


def requests_over_time(
    session: Session, since: datetime, until: datetime, tenant_id: int | None = None, num_buckets: int = 30
) -> tuple[dict[str, dict[str, float]], list[str]]:
    """Users' requests per tier (edge, cloud) in ``num_buckets`` equal slices of the window:
    ``({tier: {label: n}}, labels)``."""
    bucket_s = (until - since).total_seconds() / num_buckets
    fmt = "%H:%M:%S" if bucket_s < 60 else "%H:%M"
    labels = [(since + timedelta(seconds=i * bucket_s)).strftime(fmt) for i in range(num_buckets)]
    bucket = _bucket_of(session, since, bucket_s)
    query = select(col(UsageRecord.tier), bucket, func.count()).where(
        col(UsageRecord.occurred_at) >= since,
        col(UsageRecord.occurred_at) < until,
        col(UsageRecord.tier).in_(ANSWER_TIERS),  # users' requests, as the tiles count them
    )
    if tenant_id is not None:
        query = query.where(col(UsageRecord.tenant_id) == tenant_id)
    series: dict[str, dict[str, float]] = {}
    for tier, index, n in session.exec(query.group_by(col(UsageRecord.tier), bucket)):
        label = labels[min(max(int(index), 0), num_buckets - 1)]
        by_label = series.setdefault(str(tier), {})
        by_label[label] = by_label.get(label, 0.0) + float(n)
    return series, labels


def _window(minutes: int | None) -> int:
    return minutes if minutes in WINDOWS_MIN else WINDOWS_MIN[0]


def _stats(db: Engine, minutes: int, tenant: str) -> dict[str, Any]:
    now = datetime.now(UTC)
    with Session(db) as session:
        tenant_id = None
        if tenant:
            tenant_id = tenancy.get_tenant(session, tenant).id
        counts = {
            "tenants": session.exec(select(func.count()).select_from(Tenant)).one(),
            "active API keys": session.exec(
                select(func.count()).select_from(ApiKey).where(col(ApiKey.revoked_at).is_(None))
            ).one(),
            "models": session.exec(select(func.count()).select_from(Model)).one(),
            "devices": session.exec(select(func.count()).select_from(Device)).one(),
            "active rollouts": session.exec(
                select(func.count()).select_from(Rollout).where(col(Rollout.status).in_(("running", "paused")))
            ).one(),
        }
        since = now - timedelta(minutes=minutes)
        series, labels = requests_over_time(session, since, now, tenant_id)
        return {
            "traffic": traffic(session, since, now, tenant_id),
            "chart": stacked_columns(series, labels, unit="requests", height=160),
            "tenant": tenant,
            "tenants": list(session.exec(select(Tenant.name).order_by(Tenant.name).limit(500))),
            "counts": counts,
            "window": minutes,
            "windows": WINDOWS_MIN,
            "updated_at": now,
        }


@get("/", sync_to_thread=True)
def overview(request: Request[Any, Any, Any], db: Engine, window: int | None = None, tenant: str = "") -> Template:
    """The installation at a glance: traffic now (of every tenant, or one) and what is configured."""
    stats = _stats(db, _window(window), tenant.strip()[:64])
    return render(request, "overview.html.j2", quality_alerts=open_alerts(db), **stats)


@get("/overview/stats", sync_to_thread=True)
def overview_stats(
    request: Request[Any, Any, Any], db: Engine, window: int | None = None, tenant: str = ""
) -> Template:
    """The numbers alone, polled by the overview page every 5 s."""
    return render(request, "partials/overview_stats.html.j2", **_stats(db, _window(window), tenant.strip()[:64]))


HANDLERS = [overview, overview_stats]
