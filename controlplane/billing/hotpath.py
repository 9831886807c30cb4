"""The billing of one gateway request on PostgreSQL in one SQL statement per phase: reserve, checkpoint, settle.

The general path (``budgets.reserve_request``, ``ledger.checkpoint``, ``ledger.settle_checkpointed``) runs each
phase as a transaction of several ORM statements in a worker thread: about 14 round trips per streamed request.
Here each phase is one autocommit statement (data-modifying ``WITH``), run on a psycopg connection (awaited on
the event loop through ``cloud.gateway.pg_async``, or blocking), with the same effects:

- **reserve**: the tenant's month row takes the amount only while ``spent + reserved + amount <= budget`` (the
  row is re-checked under its lock, as in ``budgets._hold_in``) and the ``budget_reservation`` row (same lease)
  is inserted in the same statement. The statement also checks that the fast path applies: the tenant is not
  prepaid and no scoped budget applies to the request (the same match as ``scopes.applicable``). When it does
  not apply, or the month row is missing, or the budget cannot cover the amount, nothing is written and the
  caller runs the general path (``FALLBACK``), which creates rows, reclaims expired reservations and raises
  the precise ``BudgetExceededError``. A stream's reservation also inserts its first checkpoint (its prompt, no
  completion yet) when the reservation applies (``reserve_and_open_async``): its first bytes need no statement.
- **checkpoint**: the upsert of ``ledger.checkpoint``, as is.
- **settle**: the reservation deleted (by whoever comes first: this settle or the sweeper), the month's hold
  released only when this statement deleted it, the usage record inserted ``ON CONFLICT (id) DO NOTHING`` and the
  checkpoint deleted. The cost moves to ``spent`` only when the reservation or the record was this statement's:
  a replayed settle (its reservation gone and its record stored) counts nothing twice. A record id already
  stored with a different payload is a conflict, found in the same statement (the stored record's identity is
  read back) and reported as ``ledger.ingest_usage`` does. Holds on credit or on scoped budget windows settle
  through the general path (``settles_fast`` is False for them).
"""

from __future__ import annotations

import enum
import logging
import types
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any, Final

from controlplane.billing.budgets import BudgetHold
from controlplane.billing.ledger import _IDENTITY, CHECKPOINT_COUNTS, NewUsage, _identity, _row, checkpoint_row
from controlplane.billing.pricing import period_of
from controlplane.billing.scopes import EVERY_USER, Attribution
from controlplane.storage.tables import UsageCheckpoint
from controlplane.storage.types import as_utc, to_micros

logger = logging.getLogger(__name__)


class Fallback(enum.Enum):
    """The fast path does not apply: run the general one (nothing was written)."""

    FALLBACK = "fallback"


FALLBACK: Final = Fallback.FALLBACK


_RESERVE_CTES = """
WITH eligible AS (
    SELECT NOT EXISTS (SELECT 1 FROM credit_account WHERE tenant_id = %(tenant_id)s)
       AND NOT EXISTS (
           SELECT 1 FROM budget
           WHERE tenant_id = %(tenant_id)s
             AND (scope = 'tenant'
                  OR (scope = 'key' AND ref = %(key_ref)s::text)
                  OR (scope = 'project' AND ref = %(project_ref)s::text)
                  OR (scope = 'user' AND %(subject)s::text IS NOT NULL AND ref IN (%(subject)s::text, %(every)s)))
       ) AS ok
), held AS (
    UPDATE budget_period SET reserved = reserved + %(amount)s::numeric
    WHERE tenant_id = %(tenant_id)s AND period = %(period)s
      AND %(budget)s::numeric IS NOT NULL
      AND spent + reserved + %(amount)s::numeric <= %(budget)s::numeric
      AND (SELECT ok FROM eligible)
    RETURNING tenant_id
), inserted AS (
    INSERT INTO budget_reservation (id, tenant_id, period, amount, created_at, expires_at, windows, on_credit)
    SELECT %(id)s, tenant_id, %(period)s, %(amount)s::numeric, %(now)s, %(expires_at)s, NULL, false FROM held
    RETURNING id
)"""
_RESERVE = _RESERVE_CTES + "\nSELECT (SELECT ok FROM eligible), EXISTS (SELECT 1 FROM inserted)\n"

# ``ledger.checkpoint``'s upsert: the row of ``ledger.checkpoint_row``, a later write moving only its counts.
_CHECKPOINT_COLUMNS = tuple(checkpoint_row(NewUsage("", 0, "", "", datetime.now(UTC)), None, 0.0))
_CHECKPOINT = f"""
INSERT INTO usage_checkpoint ({", ".join(_CHECKPOINT_COLUMNS)})
VALUES ({", ".join(f"%({c})s" for c in _CHECKPOINT_COLUMNS)})
ON CONFLICT (id) DO UPDATE SET {", ".join(f"{c} = EXCLUDED.{c}" for c in CHECKPOINT_COUNTS)}
"""


def _column_types() -> dict[str, str]:
    """``usage_checkpoint``'s columns and the PostgreSQL type a parameter is cast to before it is stored in one
    (without lengths: a cast to ``varchar(n)`` would cut a long value where the column's assignment refuses it)."""
    kinds = {datetime: "timestamptz", int: "integer", Decimal: "numeric", str: "text"}
    table = UsageCheckpoint.__table__  # type: ignore[attr-defined]
    return {c.name: kinds[getattr(c.type, "impl_instance", c.type).python_type] for c in table.columns}


# A stream's first checkpoint, written by its reservation's statement (``reservation(opening=...)``): inserted only
# when the reservation applies (the fast path's conditions, and the hold taken when the month has a budget). Each
# parameter is cast: in a SELECT list it is not typed by the INSERT's target columns as in VALUES.
_TYPES = _column_types()
_OPENED = f"""
, opened AS (
    INSERT INTO usage_checkpoint ({", ".join(_CHECKPOINT_COLUMNS)})
    SELECT {", ".join(f"%(c_{c})s::{_TYPES[c]}" for c in _CHECKPOINT_COLUMNS)}
    WHERE (SELECT ok FROM eligible) AND (%(budget)s::numeric IS NULL OR EXISTS (SELECT 1 FROM held))
    ON CONFLICT (id) DO NOTHING
    RETURNING id
)
SELECT (SELECT ok FROM eligible), EXISTS (SELECT 1 FROM inserted), EXISTS (SELECT 1 FROM opened)
"""
_RESERVE_OPENING = _RESERVE_CTES + _OPENED


# The columns of a usage record (``ledger._row``'s) and those that make two records with one id the same record.
_RECORD_COLUMNS = tuple(_row(NewUsage("", 0, "", "", datetime.now(UTC)), (None, None), datetime.now(UTC)))
_IDENTITY_COLUMNS = (*_IDENTITY, "reported_at", "occurred_at")  # what ``ledger._identity`` reads


def _settle_sql(with_record: bool) -> str:
    if with_record:
        recorded = (
            f"INSERT INTO usage_record ({', '.join(_RECORD_COLUMNS)}) "
            f"VALUES ({', '.join(f'%(r_{c})s' for c in _RECORD_COLUMNS)}) "
            "ON CONFLICT (id) DO NOTHING RETURNING id"
        )
        stored = ", ".join(f"stored.{c}" for c in _IDENTITY_COLUMNS)
        read_back = "LEFT JOIN usage_record stored ON stored.id = %(id)s"
        # The key's last use, as ``ledger._touch_keys`` writes it: at most once a minute per key.
        touched = """, touched AS (
    UPDATE api_key SET last_used_at = %(r_occurred_at)s::timestamptz
    WHERE id = %(r_api_key_id)s::integer AND EXISTS (SELECT 1 FROM recorded)
      AND (last_used_at IS NULL OR last_used_at < %(r_occurred_at)s::timestamptz - interval '1 minute')
    RETURNING id
)"""
    else:
        recorded = "SELECT NULL::varchar AS id WHERE false"
        stored = ", ".join("NULL" for _ in _IDENTITY_COLUMNS)
        read_back = ""
        touched = ""
    # The stored record is read from the statement's snapshot: one inserted by this statement is not there, one
    # stored before is; one committed by a concurrent settle meanwhile is neither inserted nor read (a race, as
    # in ``ledger._conflicts``: not a conflict).
    return f"""
WITH released AS (
    DELETE FROM budget_reservation WHERE id = %(hold_id)s::varchar RETURNING id
), recorded AS (
    {recorded}
), moved AS (
    UPDATE budget_period
    SET spent = spent + CASE WHEN EXISTS (SELECT 1 FROM released) OR EXISTS (SELECT 1 FROM recorded)
                             THEN %(actual)s::numeric ELSE 0 END,
        reserved = reserved - CASE WHEN EXISTS (SELECT 1 FROM released) THEN %(amount)s::numeric ELSE 0 END
    WHERE tenant_id = %(tenant_id)s AND period = %(period)s::varchar
    RETURNING spent
), dropped AS (
    DELETE FROM usage_checkpoint WHERE id = %(id)s AND %(checkpointed)s::boolean RETURNING id
){touched}
SELECT (SELECT spent FROM moved), EXISTS (SELECT 1 FROM recorded), {stored}
FROM (SELECT 1) AS one {read_back}
"""


_SETTLE = {True: _settle_sql(True), False: _settle_sql(False)}


@dataclass(frozen=True, slots=True)
class Reservation:
    """A prepared fast reservation: its statement's parameters and the hold it makes if it applies."""

    params: dict[str, Any]
    hold: BudgetHold | None  # None: nothing to hold (no monthly budget, and nothing else applies)
    opens: bool = False  # the statement also writes the stream's first checkpoint


def reservation(
    tenant_id: int,
    budget: Decimal | None,
    amount: Decimal,
    who: Attribution,
    at: datetime | None = None,
    lease_s: float = 600.0,
    opening: NewUsage | None = None,
) -> Reservation:
    """``budgets.reserve_request``'s arguments as the fast statement's parameters; ``opening``: a stream's usage
    so far (its prompt), stored as its first checkpoint by the same statement (``reserve_and_open_async``)."""
    now = datetime.now(UTC)
    period = period_of(at or now)
    reservation_id = uuid.uuid4().hex
    params = {
        "tenant_id": tenant_id,
        "key_ref": str(who.key_id) if who.key_id is not None else None,
        "project_ref": str(who.project_id) if who.project_id is not None else None,
        "subject": who.subject or None,
        "every": EVERY_USER,
        "amount": amount,
        "budget": budget,
        "period": period,
        "id": reservation_id,
        "now": now,
        "expires_at": now + timedelta(seconds=lease_s),
    }
    hold = BudgetHold(reservation_id, tenant_id, period, amount, budget) if budget is not None else None
    if opening is not None:
        params.update({f"c_{k}": v for k, v in checkpoint_row(opening, hold, lease_s).items()})
    return Reservation(params, hold, opens=opening is not None)


def reserved(prepared: Reservation, row: tuple[Any, ...] | None) -> BudgetHold | Fallback | None:
    """The fast reservation's outcome from its statement's row: the hold, None (nothing to hold), or FALLBACK."""
    eligible, inserted = row if row is not None else (False, False)
    if not eligible:
        return FALLBACK  # prepaid, or a scoped budget applies
    if prepared.hold is None:
        return None
    return prepared.hold if inserted else FALLBACK  # no month row yet, or the budget looks full: precise path


async def reserve_async(connection: Any, prepared: Reservation) -> BudgetHold | Fallback | None:
    """Run a fast reservation on a psycopg ``AsyncConnection`` in autocommit mode."""
    cursor = await connection.execute(_RESERVE, prepared.params)
    return reserved(prepared, await cursor.fetchone())


async def reserve_and_open_async(connection: Any, prepared: Reservation) -> tuple[BudgetHold | Fallback | None, bool]:
    """``reserve_async`` for a prepared reservation with an ``opening``: also whether the stream's first
    checkpoint was written (only when the reservation applied; never over a checkpoint of the same id)."""
    if not prepared.opens:
        raise ValueError("this reservation has no opening checkpoint: use reserve_async")
    cursor = await connection.execute(_RESERVE_OPENING, prepared.params)
    row = await cursor.fetchone()
    return reserved(prepared, row[:2] if row is not None else None), bool(row is not None and row[2])


def reserve_blocking(connection: Any, prepared: Reservation) -> BudgetHold | Fallback | None:
    """Run a fast reservation on a psycopg ``Connection`` in autocommit mode."""
    return reserved(prepared, connection.execute(_RESERVE, prepared.params).fetchone())


async def checkpoint_async(connection: Any, usage: NewUsage, hold: BudgetHold | None, lease_s: float) -> None:
    await connection.execute(_CHECKPOINT, checkpoint_row(usage, hold, lease_s))


def checkpoint_blocking(connection: Any, usage: NewUsage, hold: BudgetHold | None, lease_s: float) -> None:
    connection.execute(_CHECKPOINT, checkpoint_row(usage, hold, lease_s))


def settles_fast(usage: NewUsage, hold: BudgetHold | None) -> bool:
    """Whether ``settle`` applies: the record arrives rated, and the hold (if any) is on the month alone."""
    return usage.rating is not None and (hold is None or (not hold.on_credit and not hold.windows))


@dataclass(frozen=True, slots=True)
class Settled:
    """What a fast settle did: the period's settled spend (None without a hold), whether the record was
    inserted, and whether its id was held by a different record (a conflict; else a replay: a duplicate)."""

    spent: Decimal | None
    inserted: bool
    conflict: bool
    has_record: bool

    @property
    def duplicate(self) -> bool:
        return self.has_record and not self.inserted and not self.conflict


def _settle_statement(usage: NewUsage, hold: BudgetHold | None, checkpointed: bool) -> tuple[str, dict[str, Any]]:
    if not settles_fast(usage, hold):
        raise ValueError("this settle needs the general path (ledger.settle_checkpointed)")
    has_record = bool(usage.prompt_tokens or usage.completion_tokens or usage.rows)
    cost = usage.rating[1] if usage.rating is not None else None
    params: dict[str, Any] = {
        "id": usage.id,
        "hold_id": hold.id if hold is not None else None,
        "tenant_id": hold.tenant_id if hold is not None else usage.tenant_id,
        "period": hold.period if hold is not None else None,
        "amount": hold.amount if hold is not None else Decimal(0),
        "actual": min(cost or Decimal(0), hold.amount) if hold is not None else Decimal(0),
        "checkpointed": checkpointed,
    }
    if has_record:
        row = _row(usage, usage.rating, datetime.now(UTC))  # type: ignore[arg-type]
        row["cost"] = to_micros(row["cost"]) if row["cost"] is not None else None  # a Micros column: integer micros
        params.update({f"r_{name}": value for name, value in row.items()})
    return _SETTLE[has_record], params


def _settled(usage: NewUsage, row: tuple[Any, ...]) -> Settled:
    spent, inserted = row[0], bool(row[1])
    has_record = bool(usage.prompt_tokens or usage.completion_tokens or usage.rows)
    stored = dict(zip(_IDENTITY_COLUMNS, row[2:], strict=True))
    conflict = False
    if has_record and not inserted and stored["tenant_id"] is not None:
        stored["occurred_at"] = as_utc(stored["occurred_at"])
        conflict = _identity(types.SimpleNamespace(**stored)) != _identity(usage)  # type: ignore[arg-type]
    if conflict:
        logger.warning(
            "%d usage record(s) reuse a stored id with a different payload and were not stored: %s", 1, usage.id
        )
    return Settled(Decimal(spent) if spent is not None else None, inserted, conflict, has_record)


async def settle_async(connection: Any, usage: NewUsage, hold: BudgetHold | None, checkpointed: bool) -> Settled:
    """A request's end in one statement, on a psycopg ``AsyncConnection`` in autocommit mode (``settles_fast``
    must hold)."""
    sql, params = _settle_statement(usage, hold, checkpointed)
    cursor = await connection.execute(sql, params)
    return _settled(usage, await cursor.fetchone())


def settle_blocking(connection: Any, usage: NewUsage, hold: BudgetHold | None, checkpointed: bool) -> Settled:
    """``settle_async`` on a psycopg ``Connection``."""
    sql, params = _settle_statement(usage, hold, checkpointed)
    return _settled(usage, connection.execute(sql, params).fetchone())
