"""The usage ledger: batched, idempotent ingestion of usage records with rating, and usage totals.

Ingestion is one multi-row ``INSERT ... ON CONFLICT (id) DO NOTHING RETURNING id`` per batch: a record id
the ledger already holds (a retried sync batch, a request the cloud metered itself) is skipped, never
overwritten, so replaying a batch changes nothing. Each new record is rated with the price in force at its
own time (price id and cost stamped on it); a record with no price is stored unpriced (flagged), never
dropped. Only the records this call really inserted count against the tenant's budget.

Sums of money are taken in SQL as integers of 1e-6 (the storage scale of a record's cost), so they are exact
on SQLite (which stores NUMERIC as a float) and PostgreSQL alike.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

from sqlalchemy import BigInteger, Integer, case, cast, func
from sqlalchemy import select as sql_select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.sql.elements import ColumnElement
from sqlmodel import Session, col, select

from controlplane.billing.budgets import add_spend
from controlplane.billing.pricing import PriceIndex, Tokens, cost, period_bounds, period_of
from controlplane.storage.tables import Price, UsageRecord
from shared.errors import ValidationError

MICROS = Decimal(1_000_000)
GROUP_BY = ("day", "month", "model", "version", "tier")


@dataclass(frozen=True, slots=True)
class NewUsage:
    """A usage record on its way into the ledger (rating fills in its price and cost)."""

    id: str
    tenant_id: int
    model: str
    tier: str
    occurred_at: datetime
    model_version: int | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0
    api_key_id: int | None = None
    device_id: str | None = None
    status: str = "ok"
    latency_ms: float | None = None
    ttft_ms: float | None = None
    rollout_arm: str | None = None
    escalation_reason: str | None = None


@dataclass(frozen=True, slots=True)
class IngestResult:
    accepted: int
    duplicates: int
    unpriced: int
    accepted_ids: frozenset[str]


def load_prices(session: Session) -> PriceIndex:
    """The whole price book, indexed by model: one query per batch, however many records it rates."""
    return PriceIndex(session.exec(select(Price)).all())


def _aware(ts: datetime) -> datetime:
    """In UTC (naive means UTC): SQLite stores the wall time without its offset, so every bound is UTC."""
    return ts.astimezone(UTC) if ts.tzinfo else ts.replace(tzinfo=UTC)


Rate = Callable[[NewUsage], tuple[int | None, Decimal | None]]


def rater(prices: PriceIndex) -> Rate:
    """Rate a record with the price in force at its own time: ``(price id, cost)``, or ``(None, None)``."""

    def rate(u: NewUsage) -> tuple[int | None, Decimal | None]:
        price = prices.lookup(u.model, u.model_version, u.tier, _aware(u.occurred_at))
        if price is None:
            return None, None
        return getattr(price, "id", None), cost(
            price, Tokens(u.prompt_tokens, u.completion_tokens, u.cached_prompt_tokens)
        )

    return rate


def _row(u: NewUsage, rating: tuple[int | None, Decimal | None], now: datetime) -> dict[str, Any]:
    price_id, amount = rating
    return {
        "id": u.id,
        "tenant_id": u.tenant_id,
        "api_key_id": u.api_key_id,
        "device_id": u.device_id,
        "model": u.model,
        "model_version": u.model_version,
        "tier": u.tier,
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "cached_prompt_tokens": u.cached_prompt_tokens,
        "status": u.status,
        "latency_ms": u.latency_ms,
        "ttft_ms": u.ttft_ms,
        "rollout_arm": u.rollout_arm,
        "escalation_reason": u.escalation_reason,
        "price_id": price_id,
        "cost": amount,
        "invoice_id": None,
        "occurred_at": _aware(u.occurred_at),
        "ingested_at": now,
    }


def _insert_new(session: Session, rows: list[dict[str, Any]]) -> frozenset[str]:
    """Insert ``rows`` whose id is not stored yet, atomically against concurrent ingestion; the ids inserted.

    PostgreSQL gets one array per column through ``unnest``: a short statement whatever the batch size
    (a multi-row VALUES list of 20 columns x 500 rows spends most of its time being parsed). SQLite gets
    SQLAlchemy's multi-row insert.
    """
    table = UsageRecord.__table__  # type: ignore[attr-defined]
    names = list(rows[0])
    if session.get_bind().dialect.name == "postgresql":
        dialect = postgresql.dialect()
        arrays = ", ".join(f"%({n})s::{table.c[n].type.compile(dialect=dialect)}[]" for n in names)
        sql = (
            f"INSERT INTO {table.name} ({', '.join(names)}) SELECT * FROM unnest({arrays}) "
            "ON CONFLICT (id) DO NOTHING RETURNING id"
        )
        params = {n: [r[n] for r in rows] for n in names}
        return frozenset(r[0] for r in session.connection().exec_driver_sql(sql, params))
    insert = sqlite.insert(table).on_conflict_do_nothing(index_elements=["id"]).returning(table.c.id)
    return frozenset(r[0] for r in session.connection().execute(insert, rows))


def ingest_usage(
    session: Session,
    records: Iterable[NewUsage],
    prices: PriceIndex | None = None,
    *,
    rate: Rate | None = None,
    count_spend: bool = True,
) -> IngestResult:
    """Rate and store ``records``, skipping ids already stored (or repeated in the batch). The caller commits.

    Args:
        session: the transaction to insert in; a batch is stored whole or not at all.
        records: the batch, in any order, duplicates allowed.
        prices: the price book to rate with (``load_prices``); None loads it.
        rate: rates a record instead (a caller with its own cached price book); ``prices`` is then unused.
        count_spend: add the cost of each inserted record to its tenant's budget period (of its own time).
    """
    batch: dict[str, NewUsage] = {}
    num_in = 0
    for u in records:
        num_in += 1
        batch.setdefault(u.id, u)
    if not batch:
        return IngestResult(0, num_in, 0, frozenset())
    if rate is None:
        rate = rater(prices if prices is not None else load_prices(session))
    now = datetime.now(UTC)
    rows = [_row(u, rate(u), now) for u in batch.values()]
    accepted = _insert_new(session, rows)
    unpriced = 0
    spend: dict[tuple[int, str], Decimal] = {}
    for row in rows:
        if row["id"] not in accepted:
            continue
        if row["cost"] is None:
            unpriced += 1
        elif row["cost"]:
            key = (row["tenant_id"], period_of(row["occurred_at"]))
            spend[key] = spend.get(key, Decimal(0)) + row["cost"]
    if count_spend:
        for (tenant_id, period), amount in sorted(spend.items()):
            add_spend(session, tenant_id, period_bounds(period)[0], amount)
    return IngestResult(len(accepted), num_in - len(accepted), unpriced, accepted)


# --- totals ---------------------------------------------------------------------------------------------------


def utc_format(session: Session, column: Any, fmt: str) -> ColumnElement[str]:
    """A timestamp column as UTC text: ``fmt`` is ``"day"`` (YYYY-MM-DD) or ``"month"`` (YYYY-MM)."""
    if session.get_bind().dialect.name == "postgresql":
        pattern = {"day": "YYYY-MM-DD", "month": "YYYY-MM"}[fmt]
        return func.to_char(func.timezone("UTC", column), pattern)
    return func.strftime({"day": "%Y-%m-%d", "month": "%Y-%m"}[fmt], column)


def cost_micros() -> ColumnElement[Any]:
    """The exact sum of the records' costs, in integer units of 1e-6 (unpriced records add 0)."""
    return func.coalesce(func.sum(cast(func.round(col(UsageRecord.cost) * 1_000_000), BigInteger)), 0)


def unpriced_count() -> ColumnElement[Any]:
    return func.coalesce(func.sum(case((col(UsageRecord.cost).is_(None), 1), else_=0)), 0)


def token_sums() -> list[ColumnElement[Any]]:
    return [
        func.count(),
        cast(func.coalesce(func.sum(col(UsageRecord.prompt_tokens)), 0), Integer),
        cast(func.coalesce(func.sum(col(UsageRecord.completion_tokens)), 0), Integer),
        cast(func.coalesce(func.sum(col(UsageRecord.cached_prompt_tokens)), 0), Integer),
    ]


def parse_group_by(text: str | None) -> list[str]:
    """``"day,model"`` -> ``["day", "model"]``; ValidationError names ``group_by`` for anything else."""
    if not text:
        return []
    dims = [d.strip() for d in text.split(",") if d.strip()]
    for d in dims:
        if d not in GROUP_BY:
            raise ValidationError(f"group_by: {d!r} is not one of {', '.join(GROUP_BY)}", param="group_by")
    if len(set(dims)) != len(dims):
        raise ValidationError("group_by: a dimension is repeated", param="group_by")
    return dims


def _totals(requests: int, prompt: int, completion: int, cached: int, micros: Any, unpriced: int) -> dict[str, Any]:
    return {
        "requests": int(requests),
        "prompt_tokens": int(prompt),
        "completion_tokens": int(completion),
        "cached_prompt_tokens": int(cached),
        "total_tokens": int(prompt) + int(completion),
        "cost": str(Decimal(int(micros)).scaleb(-6)),
        "unpriced_records": int(unpriced),
    }


def usage_totals(
    session: Session, tenant_id: int, start: datetime, end: datetime, group_by: Sequence[str] = ()
) -> dict[str, Any]:
    """Requests, tokens and cost of a tenant's records with ``start <= occurred_at < end``, grouped.

    Returns ``{"from", "to", "group_by", "totals", "groups": [{<dimension>: value, ..., <totals>}]}``;
    the groups' totals add up to ``totals`` exactly.
    """
    dims: dict[str, Any] = {
        "day": utc_format(session, col(UsageRecord.occurred_at), "day"),
        "month": utc_format(session, col(UsageRecord.occurred_at), "month"),
        "model": col(UsageRecord.model),
        "version": col(UsageRecord.model_version),
        "tier": col(UsageRecord.tier),
    }
    keys = [dims[d] for d in group_by]
    where = (
        col(UsageRecord.tenant_id) == tenant_id,
        col(UsageRecord.occurred_at) >= _aware(start),
        col(UsageRecord.occurred_at) < _aware(end),
    )
    query = sql_select(*keys, *token_sums(), cost_micros(), unpriced_count()).where(*where)
    if keys:
        query = query.group_by(*keys).order_by(*keys)
    groups = []
    overall = [0, 0, 0, 0, 0, 0]
    for row in session.execute(query).all():
        values = list(row)
        measures = values[len(keys) :]
        if not keys and int(measures[0]) == 0:
            break
        overall = [a + int(b) for a, b in zip(overall, measures, strict=True)]
        groups.append({**dict(zip(group_by, values[: len(keys)], strict=True)), **_totals(*measures)})
    return {
        "from": _aware(start).isoformat(),
        "to": _aware(end).isoformat(),
        "group_by": list(group_by),
        "totals": _totals(*overall),
        "groups": groups,
    }
