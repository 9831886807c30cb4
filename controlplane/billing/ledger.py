"""The usage ledger: the one writer of usage records. Batched, idempotent ingestion with rating, and usage totals.

Cloud metering (``cloud.gateway.metering.UsageWriter``) and edge sync (``controlplane.fleet.devices.ingest``) both hand
their records to ``ingest_usage``. Ingestion is one multi-row ``INSERT ... ON CONFLICT (id) DO NOTHING
RETURNING id`` per batch: a record id the ledger already holds is never overwritten. A replay of the same record
(a retried sync batch) is a silent duplicate, so replaying a batch changes nothing; the same id with a different
payload is a *conflict*, logged and counted, never a silent skip. Ids are namespaced by their source, so one
source cannot take another's: the cloud's own ids (request uuids, ``idem-``, ``job_``) and a device's, which
are stored as ``edge-...`` derived from tenant, device and the device's own id
(``controlplane.fleet.devices.device_usage_id``). Each new record is rated
with the price in force at its own time (``controlplane.billing.pricing.rate``; price id and cost stamped on it)
unless it arrives rated (the cloud rates a request when it settles its budget hold); a record with no price is
stored unpriced (flagged), never dropped.

A record's cost is stored as integer micros (``controlplane.storage.types.Micros``), so every sum of it taken
in SQL (``cost_total``) is exact on SQLite and PostgreSQL alike.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

from sqlalchemy import BigInteger, case, cast, delete, func, or_, update
from sqlalchemy import select as sql_select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Engine
from sqlalchemy.sql.elements import ColumnElement
from sqlmodel import Session, col, select

from controlplane.billing.budgets import BudgetHold, add_spend, load_price_index, settle_in
from controlplane.billing.pricing import PriceIndex, PriceLookup, Rating, Tokens, period_bounds, period_of, rate
from controlplane.billing.scopes import Attribution
from controlplane.storage.tables import ApiKey, BudgetReservation, UsageCheckpoint, UsageRecord
from controlplane.storage.types import as_utc, from_micros, to_micros
from shared.errors import ValidationError

logger = logging.getLogger(__name__)

GROUP_BY = ("day", "month", "model", "version", "tier")

# What makes two records with one id the same record: the billed facts, as the source reported them.
_IDENTITY = (
    "tenant_id",
    "device_id",
    "model",
    "model_version",
    "tier",
    "prompt_tokens",
    "completion_tokens",
    "cached_prompt_tokens",
    "rows",
    "status",
)


@dataclass(frozen=True, slots=True)
class NewUsage:
    """A usage record on its way into the ledger.

    ``reported_at`` is the source's own time when it lay outside the accepted window and ``occurred_at`` is
    the clamped time the record is booked at (None: booked at the reported time). ``rating`` is
    ``(price id, cost)`` when the record arrives rated (the cloud's, rated when its budget hold settled;
    ``(None, None)`` is unpriced); None has the ledger rate it.
    """

    id: str
    tenant_id: int
    model: str
    tier: str
    occurred_at: datetime
    model_version: int | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0
    rows: int = 0
    api_key_id: int | None = None
    device_id: str | None = None
    status: str = "ok"
    latency_ms: float | None = None
    ttft_ms: float | None = None
    engine_ms: float | None = None
    rollout_arm: str | None = None
    escalation_reason: str | None = None
    rating: Rating | None = None
    reported_at: datetime | None = None
    usage_source: str | None = None
    subject: str | None = None  # the end user whose budgets the record counts against (not stored), else the batch's
    is_settled: bool = False  # its cost was settled by a budget hold already: counted against no budget (not stored)


@dataclass(frozen=True, slots=True)
class IngestResult:
    accepted: int
    duplicates: int
    unpriced: int
    accepted_ids: frozenset[str]
    conflicts: int = 0
    """records not stored because their id is held by a record with a different payload"""


def load_prices(session: Session) -> PriceIndex:
    """The whole price book (prices, plans, overrides), indexed: read once per batch, however many records."""
    return load_price_index(session)


Rate = Callable[[NewUsage], Rating]


def rater(prices: PriceLookup) -> Rate:
    """Rate a record with the price in force at its own time: ``(price id, cost)``, or ``(None, None)``."""

    def rate_usage(u: NewUsage) -> Rating:
        tokens = Tokens(u.prompt_tokens, u.completion_tokens, u.cached_prompt_tokens, rows=u.rows)
        return rate(prices, u.model, u.model_version, u.tier, tokens, as_utc(u.occurred_at), u.tenant_id)

    return rate_usage


def _row(u: NewUsage, rating: Rating, now: datetime) -> dict[str, Any]:
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
        "rows": u.rows,
        "status": u.status,
        "latency_ms": u.latency_ms,
        "ttft_ms": u.ttft_ms,
        "engine_ms": u.engine_ms,
        "rollout_arm": u.rollout_arm,
        "escalation_reason": u.escalation_reason,
        "price_id": price_id,
        "cost": amount,
        "invoice_id": None,
        "occurred_at": as_utc(u.occurred_at),
        "reported_at": as_utc(u.reported_at) if u.reported_at is not None else None,
        "usage_source": u.usage_source,
        "ingested_at": now,
    }


_UNNEST: dict[tuple[tuple[str, ...], str], tuple[str, list[Any]]] = {}


def _unnest_insert(names: tuple[str, ...], dialect: Any) -> tuple[str, list[Any]]:
    """The ``unnest`` INSERT of ``usage_record`` for these columns and each column's bind conversion, built once
    per column list and driver, not compiled again for every request it stores."""
    cached = _UNNEST.get((names, dialect.driver))
    if cached is None:
        table = UsageRecord.__table__  # type: ignore[attr-defined]
        pg = postgresql.dialect()
        arrays = ", ".join(f"%({n})s::{table.c[n].type.compile(dialect=pg)}[]" for n in names)
        sql = (
            f"INSERT INTO {table.name} ({', '.join(names)}) SELECT * FROM unnest({arrays}) "
            "ON CONFLICT (id) DO NOTHING RETURNING id"
        )
        cached = _UNNEST[(names, dialect.driver)] = (sql, [table.c[n].type.bind_processor(dialect) for n in names])
    return cached


def _insert_new(session: Session, rows: list[dict[str, Any]]) -> frozenset[str]:
    """Insert ``rows`` whose id is not stored yet, atomically against concurrent ingestion; the ids inserted.

    PostgreSQL gets one array per column through ``unnest``: a short statement whatever the batch size
    (a multi-row VALUES list of 20 columns x 500 rows spends most of its time being parsed). The driver gets
    those arrays without the columns' own bind conversion, so it is applied here (cost to micros). SQLite gets
    SQLAlchemy's multi-row insert.
    """
    table = UsageRecord.__table__  # type: ignore[attr-defined]
    names = list(rows[0])
    dialect = session.get_bind().dialect
    if dialect.name == "postgresql":
        sql, converters = _unnest_insert(tuple(names), dialect)
        params = {}
        for n, convert in zip(names, converters, strict=True):
            params[n] = [r[n] for r in rows] if convert is None else [convert(r[n]) for r in rows]
        return frozenset(r[0] for r in session.connection().exec_driver_sql(sql, params))
    insert = sqlite.insert(table).on_conflict_do_nothing(index_elements=["id"]).returning(table.c.id)
    return frozenset(r[0] for r in session.connection().execute(insert, rows))


def ingest_usage(
    session: Session,
    records: Iterable[NewUsage],
    prices: PriceLookup | None = None,
    *,
    count_spend: bool = True,
    attribution: Attribution | None = None,
) -> IngestResult:
    """Rate and store ``records``, skipping ids already stored (or repeated in the batch). The caller commits.

    Args:
        session: the transaction to insert in; a batch is stored whole or not at all.
        records: the batch, in any order, duplicates allowed.
        prices: the price book to rate unrated records with (``load_prices``, or the cloud's cached
            ``PriceBook``); None loads it when a record needs rating.
        count_spend: add the cost of each inserted record to its tenant's budget period and scoped budget
            windows (of its own day); False for records whose cost a budget hold already settled (a record's own
            ``is_settled`` says so for that record alone).
        attribution: the key, project and end user the batch's spend also counts against (a device's); a
            record's own ``subject`` replaces the end user for that record.
    """
    batch: dict[str, NewUsage] = {}
    num_in = 0
    conflicting: list[str] = []
    for u in records:
        num_in += 1
        first = batch.setdefault(u.id, u)
        if first is not u and _identity(first) != _identity(u):
            conflicting.append(u.id)
    if not batch:
        return IngestResult(0, num_in, 0, frozenset())
    rate_usage: Rate | None = None
    now = datetime.now(UTC)
    rows = []
    for u in batch.values():
        if u.rating is None and rate_usage is None:
            rate_usage = rater(prices if prices is not None else load_prices(session))
        rows.append(_row(u, u.rating if u.rating is not None else rate_usage(u), now))  # type: ignore[misc]
    accepted = _insert_new(session, rows)
    _touch_keys(session, [row for row in rows if row["id"] in accepted])
    skipped = [u for u in batch.values() if u.id not in accepted]
    if skipped:
        conflicting += _conflicts(session, skipped)
    if conflicting:
        logger.warning(
            "%d usage record(s) reuse a stored id with a different payload and were not stored: %s",
            len(conflicting),
            ", ".join(sorted(set(conflicting))[:20]),
        )
    unpriced = 0
    spend: dict[tuple[int, str, str], Decimal] = {}
    for row in rows:
        if row["id"] not in accepted:
            continue
        if row["cost"] is None:
            unpriced += 1
        elif row["cost"] and not batch[row["id"]].is_settled:
            subject = batch[row["id"]].subject or ""
            key = (row["tenant_id"], as_utc(row["occurred_at"]).strftime("%Y-%m-%d"), subject)
            spend[key] = spend.get(key, Decimal(0)) + row["cost"]
    if count_spend:  # per day: a daily budget's window is the record's own day (its month is the day's)
        for (tenant_id, day, subject), amount in sorted(spend.items()):
            at = datetime.strptime(day, "%Y-%m-%d").replace(tzinfo=UTC)
            who = attribution or Attribution()
            # A record naming its own end user counts against that user's budgets, not the batch's default.
            add_spend(session, tenant_id, at, amount, replace(who, subject=subject) if subject else who)
    num_conflicts = len(conflicting)
    return IngestResult(len(accepted), num_in - len(accepted) - num_conflicts, unpriced, accepted, num_conflicts)


KEY_LAST_USED_GRANULARITY = timedelta(minutes=1)


def _touch_keys(session: Session, rows: list[dict[str, Any]]) -> None:
    """Each API key's last use, from the records stored for it: written at most once a minute per key (the UPDATE
    matches nothing in between), so a key used a minute ago never reads "never" and a busy key costs no write per
    request."""
    latest: dict[int, datetime] = {}
    for row in rows:
        key_id = row.get("api_key_id")
        if key_id is not None:
            at = as_utc(row["occurred_at"])
            latest[key_id] = max(latest.get(key_id, at), at)
    for key_id, at in sorted(latest.items()):
        session.execute(
            update(ApiKey)
            .where(
                col(ApiKey.id) == key_id,
                or_(col(ApiKey.last_used_at).is_(None), col(ApiKey.last_used_at) < at - KEY_LAST_USED_GRANULARITY),
            )
            .values(last_used_at=at)
            .execution_options(synchronize_session=False)
        )


def _identity(u: NewUsage | UsageRecord) -> tuple[Any, ...]:
    reported = u.reported_at if u.reported_at is not None else u.occurred_at
    # Microseconds dropped: a source's float timestamp need not survive the database's rounding exactly.
    return (*(getattr(u, name) for name in _IDENTITY), as_utc(reported).replace(microsecond=0))


def _conflicts(session: Session, skipped: list[NewUsage]) -> list[str]:
    """The ids of ``skipped`` whose stored record differs from the one offered (a missing one is a race: not)."""
    stored: dict[str, UsageRecord] = {}
    ids = [u.id for u in skipped]
    for start in range(0, len(ids), 500):
        chunk = ids[start : start + 500]
        stored.update((r.id, r) for r in session.exec(select(UsageRecord).where(col(UsageRecord.id).in_(chunk))))
    return [u.id for u in skipped if u.id in stored and _identity(stored[u.id]) != _identity(u)]


# --- checkpoints of streamed usage ------------------------------------------------------------------------------
#
# A stream's tokens reach the client before its final record is written. So the cloud writes what it has
# generated so far (``checkpoint``) before it sends them, every few tokens or ms, and the end of the stream settles
# it (``settle_checkpointed``: the final record inserted, the budget hold settled and the checkpoint deleted, in one
# transaction: the final record replaces the checkpoint, never adds to it). A checkpoint whose lease ran out was
# left by a dead process; ``reconcile_checkpoints`` bills what it holds and releases the rest of its reservation.

INTERRUPTED = "interrupted"  # the status of a record billed from a dead process's last checkpoint


# What a later checkpoint of the same stream moves forward (the rest is written once, by the first).
CHECKPOINT_COUNTS = ("prompt_tokens", "completion_tokens", "cached_prompt_tokens", "updated_at")


def checkpoint_row(usage: NewUsage, hold: BudgetHold | None, lease_s: float) -> dict[str, Any]:
    """``usage_checkpoint``'s row for ``usage`` (the stream's counts so far) under ``hold``, leased for
    ``lease_s`` from now."""
    now = datetime.now(UTC)
    return {
        "id": usage.id,
        "tenant_id": usage.tenant_id,
        "api_key_id": usage.api_key_id,
        "device_id": usage.device_id,
        "model": usage.model,
        "model_version": usage.model_version,
        "rollout_arm": usage.rollout_arm,
        "escalation_reason": usage.escalation_reason,
        "reservation_id": hold.id if hold is not None else None,
        "period": hold.period if hold is not None else None,
        "reserved": hold.amount if hold is not None else None,
        "started_at": now,
        "expires_at": now + timedelta(seconds=lease_s),
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "cached_prompt_tokens": usage.cached_prompt_tokens,
        "updated_at": now,
    }


def checkpoint(session: Session, usage: NewUsage, hold: BudgetHold | None, lease_s: float) -> None:
    """Store ``usage`` (the stream's counts so far) as its checkpoint, the first time with a lease of ``lease_s``
    (the budget hold's: a live stream never outlives it). The caller commits.

    One statement (an upsert): the first write inserts the row, a later one only moves its counts forward.
    """
    row = checkpoint_row(usage, hold, lease_s)
    counts = {k: row[k] for k in CHECKPOINT_COUNTS}
    table = UsageCheckpoint.__table__  # type: ignore[attr-defined]
    connection = session.connection()
    insert = postgresql.insert(table) if connection.dialect.name == "postgresql" else sqlite.insert(table)
    connection.execute(insert.values(row).on_conflict_do_update(index_elements=["id"], set_=counts))


def settle_checkpointed(
    session: Session, usage: NewUsage, hold: BudgetHold | None, *, checkpointed: bool = True
) -> Decimal | None:
    """A checkpointed stream's end: its final record (rated) stored, its hold settled at the record's cost, its
    checkpoint deleted, all in the caller's transaction. The period's settled spend, or None without a hold."""
    spent = None
    if hold is not None:
        cost = usage.rating[1] if usage.rating is not None else None
        spent = settle_in(session, hold, cost or Decimal(0))
    if usage.prompt_tokens or usage.completion_tokens or usage.rows:
        ingest_usage(session, [usage], count_spend=False)
    if checkpointed:  # False: the stream wrote none (a request that only held a budget)
        session.execute(delete(UsageCheckpoint).where(col(UsageCheckpoint.id) == usage.id))
    return spent


def reconcile_checkpoints(
    engine: Engine, prices: PriceLookup | None = None, *, now: datetime | None = None, limit: int = 1000
) -> int:
    """Bill the checkpoints whose lease ran out (their process died mid-stream); how many were.

    Each becomes a usage record (status ``interrupted``, booked at its last update, rated at that time, at most
    its reservation) and its budget reservation is settled at that cost: released if the sweeper has not released
    it yet, and the cost added to the period's spend either way. One transaction per checkpoint, which deletes
    it first: a checkpoint is billed once, however many processes reconcile.
    """
    now = now or datetime.now(UTC)
    stmt = select(UsageCheckpoint).where(col(UsageCheckpoint.expires_at) < now).limit(limit)
    settled = 0
    with Session(engine) as session:
        expired = list(session.exec(stmt))
        session.expunge_all()
        session.rollback()
        lookup = prices if prices is not None else (load_prices(session) if expired else None)
        for cp in expired:
            deleted = session.execute(delete(UsageCheckpoint).where(col(UsageCheckpoint.id) == cp.id))
            if deleted.rowcount != 1:  # type: ignore[attr-defined]
                session.rollback()
                continue  # settled (or reconciled) meanwhile
            if session.get(UsageRecord, cp.id) is not None:  # its stream settled; a late write left this behind
                session.commit()
                continue
            usage = NewUsage(
                id=cp.id,
                tenant_id=cp.tenant_id,
                model=cp.model,
                tier="cloud",
                occurred_at=as_utc(cp.updated_at),
                model_version=cp.model_version,
                prompt_tokens=cp.prompt_tokens,
                completion_tokens=cp.completion_tokens,
                cached_prompt_tokens=cp.cached_prompt_tokens,
                api_key_id=cp.api_key_id,
                device_id=cp.device_id,
                status=INTERRUPTED,
                rollout_arm=cp.rollout_arm,
                escalation_reason=cp.escalation_reason,
            )
            price_id, cost = rater(lookup)(usage)  # type: ignore[arg-type]
            if cost is not None and cp.reserved is not None:
                cost = min(cost, cp.reserved)
            if cp.reservation_id is not None and cp.period is not None and cp.reserved is not None:
                held = session.get(BudgetReservation, cp.reservation_id)  # its scoped windows and credit hold
                windows = tuple((int(w[0]), str(w[1]), str(w[2])) for w in (held.windows or [])) if held else ()
                on_credit = bool(held is not None and held.on_credit)
                hold = BudgetHold(cp.reservation_id, cp.tenant_id, cp.period, cp.reserved, None, windows, on_credit)
                settle_in(session, hold, cost or Decimal(0))
            result = ingest_usage(session, [replace(usage, rating=(price_id, cost))], count_spend=False)
            session.commit()
            settled += 1
            logger.warning(
                "billed usage %s of tenant %s from the checkpoint of a dead process: %d prompt + %d completion "
                "tokens%s",
                cp.id,
                cp.tenant_id,
                cp.prompt_tokens,
                cp.completion_tokens,
                "" if result.accepted else " (a record with its id was stored already)",
            )
    return settled


# --- totals ---------------------------------------------------------------------------------------------------


def utc_format(session: Session, column: Any, fmt: str) -> ColumnElement[str]:
    """A timestamp column as UTC text: ``fmt`` is ``"day"`` (YYYY-MM-DD) or ``"month"`` (YYYY-MM)."""
    if session.get_bind().dialect.name == "postgresql":
        pattern = {"day": "YYYY-MM-DD", "month": "YYYY-MM"}[fmt]
        return func.to_char(func.timezone("UTC", column), pattern)
    return func.strftime({"day": "%Y-%m-%d", "month": "%Y-%m"}[fmt], column)


def cost_total() -> ColumnElement[Decimal]:
    """The exact sum of the records' costs, a ``Decimal`` (unpriced records add 0): a sum of integer micros.

    Every sum of usage cost (totals, invoices, the console, rollout reports) is taken with this.
    """
    return func.coalesce(func.sum(col(UsageRecord.cost)), Decimal(0))


def unpriced_count() -> ColumnElement[Any]:
    return func.coalesce(func.sum(case((col(UsageRecord.cost).is_(None), 1), else_=0)), 0)


def token_sums() -> list[ColumnElement[Any]]:
    return [
        func.count(),
        cast(func.coalesce(func.sum(col(UsageRecord.prompt_tokens)), 0), BigInteger),
        cast(func.coalesce(func.sum(col(UsageRecord.completion_tokens)), 0), BigInteger),
        cast(func.coalesce(func.sum(col(UsageRecord.cached_prompt_tokens)), 0), BigInteger),
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


def _totals(requests: int, prompt: int, completion: int, cached: int, amount: Decimal, unpriced: int) -> dict[str, Any]:
    return {
        "requests": int(requests),
        "prompt_tokens": int(prompt),
        "completion_tokens": int(completion),
        "cached_prompt_tokens": int(cached),
        "total_tokens": int(prompt) + int(completion),
        "cost": str(from_micros(to_micros(amount))),
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
        col(UsageRecord.occurred_at) >= start,
        col(UsageRecord.occurred_at) < end,
    )
    query = sql_select(*keys, *token_sums(), cost_total(), unpriced_count()).where(*where)
    if keys:
        query = query.group_by(*keys).order_by(*keys)
    groups = []
    overall: list[Any] = [0, 0, 0, 0, Decimal(0), 0]
    for row in session.execute(query).all():
        values = list(row)
        measures = values[len(keys) :]
        if not keys and int(measures[0]) == 0:
            break
        overall = [a + b for a, b in zip(overall, measures, strict=True)]
        groups.append({**dict(zip(group_by, values[: len(keys)], strict=True)), **_totals(*measures)})
    return {
        "from": as_utc(start).isoformat(),
        "to": as_utc(end).isoformat(),
        "group_by": list(group_by),
        "totals": _totals(*overall),
        "groups": groups,
    }


@dataclass(frozen=True, slots=True)
class MonthSpend:
    """A tenant's spend in one calendar month (UTC) as the ledger holds it at ``as_of``: the exact sum of its
    records' rated costs (every tier, shadow replays included; unpriced records add 0 and are counted)."""

    tenant_id: int
    period: str
    amount: Decimal
    requests: int
    unpriced_records: int
    as_of: datetime


def month_spend(
    session: Session, tenant_id: int, period: str | None = None, *, now: datetime | None = None
) -> MonthSpend:
    """The one figure of a tenant's spend in ``period`` (``YYYY-MM``; default: the month of ``now``, i.e. month to
    date). The tenant page, the billing page and the invoice draft all show this sum; an invoice of the month bills
    exactly it, rounded once (``controlplane.billing.invoices``)."""
    as_of = now or datetime.now(UTC)
    period = period or period_of(as_of)
    start, end = period_bounds(period)
    query = sql_select(func.count(), cost_total(), unpriced_count()).where(
        col(UsageRecord.tenant_id) == tenant_id,
        col(UsageRecord.occurred_at) >= start,
        col(UsageRecord.occurred_at) < end,
    )
    requests, amount, unpriced = session.execute(query).one()
    return MonthSpend(tenant_id, period, from_micros(to_micros(Decimal(amount))), int(requests), int(unpriced), as_of)
