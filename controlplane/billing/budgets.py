"""Monthly budgets on the hot path: reserve the worst case before generating, settle the actual cost after.

A reservation is one conditional UPDATE, ``spent + reserved + amount <= budget``, which SQLite (one writer
at a time) and PostgreSQL (the row is re-checked under its lock) both apply atomically. So the committed
total (settled plus reserved) never exceeds the budget, however many requests race; a request's actual cost
is at most what it reserved, so settled spend never exceeds it either.

Each reservation is also a ``budget_reservation`` row, written in the same transaction, with a lease
(``expires_at``). Settling deletes the row and releases its amount; a process that dies mid-request never
settles, so its row outlives the lease and ``reclaim_expired`` (the cloud's sweeper, and ``reserve`` itself
when a tenant's budget looks full) deletes it and gives the amount back. Whoever deletes the row releases the
amount, so a reservation is released exactly once, even when a late settle races the sweeper.
"""

from __future__ import annotations

import logging
import time
import uuid
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

from sqlalchemy import BigInteger, case, delete, literal, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import IntegrityError
from sqlalchemy.sql.elements import ColumnElement
from sqlmodel import Session, col, select

from controlplane.billing import credit
from controlplane.billing.pricing import DEFAULT_PLAN, PriceIndex, PriceLike, Rating, Tokens, period_of, rate
from controlplane.billing.scopes import Attribution, ScopedWindow, applicable, remaining_in
from controlplane.storage.tables import (
    MONEY,
    BudgetPeriod,
    BudgetReservation,
    BudgetWindow,
    CreditAccount,
    Price,
    PricePlan,
    Tenant,
    TenantPlan,
)
from controlplane.storage.types import to_micros
from shared.errors import ApplicationError
from shared.periodic import Periodic

logger = logging.getLogger(__name__)

DEFAULT_LEASE_S = 600.0
ALERT_THRESHOLDS = (80, 100)


class BudgetExceededError(ApplicationError):
    """OpenAI's shape for an exhausted quota."""

    status_code = 429
    error_type = "insufficient_quota"
    code = "insufficient_quota"


@dataclass(frozen=True, slots=True)
class BudgetHold:
    """What a request holds on its budgets until it settles: the id of its ``budget_reservation`` record, the
    amount held, the tenant's monthly budget it was held against (None: the tenant has none), and the scoped
    budget windows (``controlplane.billing.scopes``) it holds the same amount on."""

    id: str
    tenant_id: int
    period: str
    amount: Decimal
    budget: Decimal | None
    windows: tuple[tuple[int, str, str], ...] = ()
    on_credit: bool = False


# Per database, the budget period and window rows this process has seen exist: a reservation skips creating them
# again (two more transactions per request otherwise). Period rows are never deleted; a window row deleted since
# (with its budget) is caught by the retry in ``reserve``.
_EXISTING: weakref.WeakKeyDictionary[Engine, set[tuple[Any, ...]]] = weakref.WeakKeyDictionary()
_MAX_EXISTING = 100_000


def _known(engine: Engine) -> set[tuple[Any, ...]]:
    known = _EXISTING.get(engine)
    if known is None:
        known = _EXISTING[engine] = set()
    return known


def _remember(engine: Engine, *keys: tuple[Any, ...]) -> None:
    known = _known(engine)
    if len(known) + len(keys) > _MAX_EXISTING:
        known.clear()
    known.update(keys)


def _ensure_row(engine: Engine, tenant_id: int, period: str) -> None:
    if ("period", tenant_id, period) in _known(engine):
        return
    _ensure_row_now(engine, tenant_id, period)
    _remember(engine, ("period", tenant_id, period))


def _ensure_row_now(engine: Engine, tenant_id: int, period: str) -> None:
    with Session(engine) as session:
        if session.get(BudgetPeriod, (tenant_id, period)) is not None:
            return
        session.add(BudgetPeriod(tenant_id=tenant_id, period=period))
        try:
            session.commit()
        except IntegrityError:  # a concurrent request created it first
            session.rollback()


def _insert_windows(connection: Connection, keys: Iterable[tuple[int, str, str]]) -> None:
    """Create the window rows that do not exist yet (a concurrent request may create the same ones)."""
    rows = [{"budget_id": b, "subject": who, "window": w, "spent": 0, "reserved": 0} for b, who, w in keys]
    if not rows:
        return
    table = BudgetWindow.__table__  # type: ignore[attr-defined]
    insert = postgresql.insert(table) if connection.dialect.name == "postgresql" else sqlite.insert(table)
    connection.execute(insert.on_conflict_do_nothing(), rows)


def _ensure_windows(engine: Engine, windows: Sequence[ScopedWindow]) -> None:
    known = _known(engine)
    missing = [w.key for w in windows if ("window", *w.key) not in known]
    if missing:
        with engine.begin() as connection:
            _insert_windows(connection, missing)
        _remember(engine, *(("window", *key) for key in missing))


def _forget(engine: Engine, windows: Sequence[ScopedWindow]) -> bool:
    """Drop the request's window rows from what is known to exist; whether any was (a failed hold may have
    missed one that was deleted since)."""
    known = _known(engine)
    keys = [k for k in (("window", *w.key) for w in windows) if k in known]
    known.difference_update(keys)
    return bool(keys)


def _window_where(key: tuple[int, str, str]) -> tuple[ColumnElement[bool], ...]:
    budget_id, subject, window = key
    return (
        col(BudgetWindow.budget_id) == budget_id,
        col(BudgetWindow.subject) == subject,
        col(BudgetWindow.window) == window,
    )


def _try_reserve(
    engine: Engine,
    tenant_id: int,
    period: str,
    budget: Decimal | None,
    amount: Decimal,
    lease_s: float,
    windows: Sequence[ScopedWindow] = (),
) -> tuple[str | None, str | None, bool]:
    """``(the new reservation's id, None, held on credit)``, or ``(None, the name of the budget that cannot cover
    amount, False)``, in a transaction of its own (``_hold_in``)."""
    with Session(engine) as session:
        held = _hold_in(session, tenant_id, period, budget, amount, lease_s, windows)
        if held[0] is None:
            session.rollback()
        else:
            session.commit()
    return held


def _hold_in(
    session: Session,
    tenant_id: int,
    period: str,
    budget: Decimal | None,
    amount: Decimal,
    lease_s: float,
    windows: Sequence[ScopedWindow] = (),
    *,
    is_prepaid: bool | None = None,
) -> tuple[str | None, str | None, bool]:
    """Hold ``amount`` in the caller's transaction (the caller commits, or rolls back when no id is returned):
    ``(the new reservation's id, None, held on credit)``, or ``(None, the name of the budget that cannot cover
    amount, False)``. A prepaid tenant's hold is on its credit while that covers ``amount`` (its month's budget is
    then not touched). ``is_prepaid``: whether the tenant has a credit account, when the transaction read it
    already (False skips the credit statements).

    The tenant's credit, then its month, then the scoped windows in one order (``scopes.applicable`` sorts them),
    so on PostgreSQL two requests never wait on each other's rows crosswise.
    """
    reservation_id = uuid.uuid4().hex
    now = datetime.now(UTC)
    micros = to_micros(amount)
    prepaid = credit.hold(session, tenant_id, amount) if is_prepaid is not False else credit.NO_ACCOUNT
    if prepaid == credit.SHORT and budget is None:
        left = credit.available(session, tenant_id)
        return None, f"the tenant's prepaid credit ({left} left)", False
    if prepaid != credit.HELD:  # not prepaid, or its credit is used up: the month's budget applies
        stmt = update(BudgetPeriod).where(col(BudgetPeriod.tenant_id) == tenant_id, col(BudgetPeriod.period) == period)
        if budget is not None:
            stmt = stmt.where(col(BudgetPeriod.spent) + col(BudgetPeriod.reserved) + amount <= budget)
        result = session.connection().execute(stmt.values(reserved=col(BudgetPeriod.reserved) + amount))
        if result.rowcount != 1:
            short = f"the tenant's monthly budget ({budget})"
            return (
                None,
                short if prepaid == credit.NO_ACCOUNT else f"the tenant's prepaid credit and {short}",
                False,
            )
    for w in windows:
        stmt = update(BudgetWindow).where(*_window_where(w.key))
        if w.is_hard:
            used = col(BudgetWindow.spent) + col(BudgetWindow.reserved) + literal(micros, BigInteger)
            stmt = stmt.where(used <= literal(to_micros(w.limit), BigInteger))
        result = session.connection().execute(
            stmt.values(reserved=col(BudgetWindow.reserved) + literal(micros, BigInteger))
        )
        if result.rowcount != 1:
            return None, f"{w.label} ({w.limit})", False
    row = BudgetReservation(
        id=reservation_id,
        tenant_id=tenant_id,
        period=period,
        amount=amount,
        created_at=now,
        expires_at=now + timedelta(seconds=lease_s),
        windows=[list(w.key) for w in windows] or None,
        on_credit=prepaid == credit.HELD,
    )
    credit.insert_row(session, row)
    return reservation_id, None, prepaid == credit.HELD


def reserve(
    engine: Engine,
    tenant_id: int,
    budget: Decimal | None,
    amount: Decimal,
    at: datetime | None = None,
    lease_s: float = DEFAULT_LEASE_S,
    windows: Sequence[ScopedWindow] = (),
) -> BudgetHold:
    """Reserve ``amount`` of the tenant's monthly ``budget`` (None: none, only counted) and of every scoped
    budget window in ``windows`` for at most ``lease_s`` seconds, all or none, or raise ``BudgetExceededError``
    naming the budget that stopped it.

    The lease must outlast the request (the cloud uses its request deadline plus a margin): a reservation still
    open when its lease expires is taken for a dead process's and released.
    """
    period = period_of(at or datetime.now(UTC))
    _ensure_row(engine, tenant_id, period)
    _ensure_windows(engine, windows)
    reservation_id, short, on_credit = _try_reserve(engine, tenant_id, period, budget, amount, lease_s, windows)
    if reservation_id is None and _forget(engine, windows):  # a window row taken to exist may be gone
        _ensure_windows(engine, windows)
        reservation_id, short, on_credit = _try_reserve(engine, tenant_id, period, budget, amount, lease_s, windows)
    if reservation_id is None and reclaim_expired(engine, tenant_id=tenant_id) > 0:
        reservation_id, short, on_credit = _try_reserve(engine, tenant_id, period, budget, amount, lease_s, windows)
    if reservation_id is None:
        raise BudgetExceededError(
            f"{short} cannot cover this request's worst case ({amount}); lower max_tokens or raise the budget"
        )
    keys = tuple(w.key for w in windows)
    return BudgetHold(reservation_id, tenant_id, period, amount, budget, keys, on_credit=on_credit)


def reserve_request(
    engine: Engine,
    tenant_id: int,
    budget: Decimal | None,
    amount: Decimal,
    who: Attribution,
    at: datetime | None = None,
    lease_s: float = DEFAULT_LEASE_S,
) -> BudgetHold | None:
    """``reserve`` for one request of ``who`` (its key, project and end user), finding the scoped budget windows
    that apply and whether the tenant is prepaid in the transaction that holds: one connection and one commit on
    the hot path (it was two transactions and two credit reads). None when nothing applies (no monthly budget, no
    scoped budget, no credit account): nothing is held. A hold that fails here is retried by ``reserve`` itself
    (window rows deleted meanwhile, expired reservations reclaimed), which raises ``BudgetExceededError``.
    """
    at = at or datetime.now(UTC)
    period = period_of(at)
    _ensure_row(engine, tenant_id, period)
    with Session(engine) as session:
        windows = applicable(session, tenant_id, at, key_id=who.key_id, project_id=who.project_id, subject=who.subject)
        is_prepaid = session.get(CreditAccount, tenant_id) is not None
        if budget is None and not windows and not is_prepaid:
            return None
        known = _known(engine)
        missing = [w.key for w in windows if ("window", *w.key) not in known]
        if missing:
            # Committed before the hold, never inside it: the hold takes its rows in one order (month, then
            # windows), and a sync's spend does too (``add_spend``). A window row inserted and not yet committed
            # here would make a sync that holds the month wait on this transaction while it waits on the month.
            _insert_windows(session.connection(), missing)
            session.commit()
            _remember(engine, *(("window", *key) for key in missing))
        reservation_id, _, on_credit = _hold_in(
            session, tenant_id, period, budget, amount, lease_s, windows, is_prepaid=is_prepaid
        )
        if reservation_id is None:
            session.rollback()
        else:
            session.commit()
    if reservation_id is None:
        return reserve(engine, tenant_id, budget, amount, at=at, lease_s=lease_s, windows=windows)
    keys = tuple(w.key for w in windows)
    return BudgetHold(reservation_id, tenant_id, period, amount, budget, keys, on_credit=on_credit)


def _move_windows(
    session: Session, keys: Iterable[Sequence[Any]], *, release: Decimal, spend: Decimal = Decimal(0)
) -> None:
    """Give back ``release`` of the windows' reservations and add ``spend`` to their settled spend."""
    for key in sorted(tuple(k) for k in keys):
        values: dict[str, Any] = {}
        if release:
            values["reserved"] = col(BudgetWindow.reserved) - literal(to_micros(release), BigInteger)
        if spend:
            values["spent"] = col(BudgetWindow.spent) + literal(to_micros(spend), BigInteger)
        if values:
            where = _window_where((int(key[0]), str(key[1]), str(key[2])))
            session.connection().execute(update(BudgetWindow).where(*where).values(**values))


def settle(engine: Engine, hold: BudgetHold, actual: Decimal) -> Decimal:
    """Release the hold and add what the request really cost (never more than it reserved).

    Returns the period's settled spend after this request. A reservation the sweeper already released (its
    lease ran out first) only adds the cost.
    """
    with Session(engine) as session:
        spent = settle_in(session, hold, actual)
        session.commit()
    return spent


def settle_in(session: Session, hold: BudgetHold, actual: Decimal) -> Decimal:
    """``settle`` in the caller's transaction (the caller commits): the ledger settles a streamed request's hold
    in the transaction that writes its usage record."""
    actual = min(actual, hold.amount)
    connection = session.connection()
    if not hold.on_credit and connection.dialect.name == "postgresql":
        # One statement: the reservation deleted (by whoever comes first: this settle or the sweeper) and the
        # month moved, releasing the hold only when this statement deleted it.
        released = (
            delete(BudgetReservation)
            .where(col(BudgetReservation.id) == hold.id)
            .returning(col(BudgetReservation.id))
            .cte("released")
        )
        is_deleted = select(released.c.id).exists()
        back = case((is_deleted, literal(hold.amount, MONEY)), else_=literal(Decimal(0), MONEY))
        spent_now, is_held = connection.execute(
            update(BudgetPeriod)
            .where(col(BudgetPeriod.tenant_id) == hold.tenant_id, col(BudgetPeriod.period) == hold.period)
            .values(spent=col(BudgetPeriod.spent) + actual, reserved=col(BudgetPeriod.reserved) - back)
            .returning(col(BudgetPeriod.spent), is_deleted)
        ).one()
        _move_windows(session, hold.windows, release=hold.amount if is_held else Decimal(0), spend=actual)
        return Decimal(spent_now)
    deleted = connection.execute(delete(BudgetReservation).where(col(BudgetReservation.id) == hold.id))
    is_held = deleted.rowcount == 1
    on_month, release = actual, hold.amount if is_held else Decimal(0)
    if hold.on_credit:
        drawn = credit.draw(session, hold.tenant_id, actual, hold.period, hold.id, held=release)
        on_month, release = actual - drawn, Decimal(0)
    values: dict[str, Any] = {"spent": col(BudgetPeriod.spent) + on_month}
    if release:
        values["reserved"] = col(BudgetPeriod.reserved) - release
    spent = (
        session.connection()
        .execute(
            update(BudgetPeriod)
            .where(col(BudgetPeriod.tenant_id) == hold.tenant_id, col(BudgetPeriod.period) == hold.period)
            .values(**values)
            .returning(col(BudgetPeriod.spent))
        )
        .scalar_one()
    )
    _move_windows(session, hold.windows, release=hold.amount if is_held else Decimal(0), spend=actual)
    return Decimal(spent)


def reclaim_expired(
    engine: Engine, *, tenant_id: int | None = None, now: datetime | None = None, limit: int = 1000
) -> int:
    """Release reservations whose lease has run out (their process died before settling); how many were."""
    now = now or datetime.now(UTC)
    stmt = select(BudgetReservation).where(col(BudgetReservation.expires_at) < now)
    if tenant_id is not None:
        stmt = stmt.where(col(BudgetReservation.tenant_id) == tenant_id)
    released = 0
    with Session(engine) as session:
        expired = [
            (r.id, r.tenant_id, r.period, r.amount, r.windows or [], r.on_credit)
            for r in session.exec(stmt.limit(limit))
        ]
        session.rollback()
        for reservation_id, owner, period, amount, windows, on_credit in expired:
            deleted = session.execute(delete(BudgetReservation).where(col(BudgetReservation.id) == reservation_id))
            if deleted.rowcount != 1:  # type: ignore[attr-defined]
                continue  # settled (or reclaimed) meanwhile: released already
            if on_credit:
                credit.release(session, owner, amount)
            else:
                session.execute(
                    update(BudgetPeriod)
                    .where(col(BudgetPeriod.tenant_id) == owner, col(BudgetPeriod.period) == period)
                    .values(reserved=col(BudgetPeriod.reserved) - amount)
                )
            _move_windows(session, windows, release=amount)
            session.commit()
            released += 1
            logger.warning(
                "released budget reservation %s of tenant %s (%s): its lease ran out", reservation_id, owner, amount
            )
    return released


def thresholds_reached(spent: Decimal, budget: Decimal) -> list[int]:
    """The alert thresholds (percent of the budget) that ``spent`` has reached."""
    if budget <= 0:
        return list(ALERT_THRESHOLDS)
    return [t for t in ALERT_THRESHOLDS if spent * 100 >= budget * t]


def add_spend(
    session: Session, tenant_id: int, at: datetime, amount: Decimal, attribution: Attribution | None = None
) -> None:
    """Spend that was not reserved (edge usage arriving at sync), in the caller's transaction: the tenant's month
    and its tenant-wide scoped budgets (per day, month, total) of that time, and those of ``attribution`` (the
    device's key, project, end user)."""
    period = period_of(at)
    month_amount = amount - credit.draw(session, tenant_id, amount, period, f"sync:{period}")
    row = session.get(BudgetPeriod, (tenant_id, period))
    if row is None:
        session.add(BudgetPeriod(tenant_id=tenant_id, period=period, spent=month_amount))
        session.flush()
    else:
        session.execute(
            update(BudgetPeriod)
            .where(col(BudgetPeriod.tenant_id) == tenant_id, col(BudgetPeriod.period) == period)
            .values(spent=col(BudgetPeriod.spent) + month_amount)
        )
    who = attribution or Attribution()
    windows = applicable(session, tenant_id, at, key_id=who.key_id, project_id=who.project_id, subject=who.subject)
    if windows:
        _insert_windows(session.connection(), [w.key for w in windows])
        _move_windows(session, [w.key for w in windows], release=Decimal(0), spend=amount)


def tightest(
    session: Session, tenant: Tenant, at: datetime | None = None, attribution: Attribution | None = None
) -> tuple[Decimal | None, str | None]:
    """What may still be spent now under the tightest hard budget that applies, and that budget's name: the
    tenant's monthly budget (a prepaid tenant: its credit plus the month's remainder), its scoped tenant budgets
    per day, month, total, and those of ``attribution`` (a device's key, its project, its end user). ``(None,
    None)``: no hard budget applies (unlimited). The edge allowance."""
    at = at or datetime.now(UTC)
    month = remaining(session, tenant.id or 0, tenant.monthly_budget, at) if tenant.monthly_budget is not None else None
    prepaid = credit.available(session, tenant.id or 0)
    left: list[tuple[Decimal, str]] = []
    if prepaid is not None:  # a prepaid tenant: its credit, then its month's budget (none: nothing after credit)
        name = "the tenant's prepaid credit" + (" and monthly budget" if month is not None else "")
        left.append((prepaid + (month or Decimal(0)), name))
    elif month is not None:
        left.append((month, "the tenant's monthly budget"))
    who = attribution or Attribution()
    windows = applicable(session, tenant.id or 0, at, key_id=who.key_id, project_id=who.project_id, subject=who.subject)
    left += [(remaining_in(session, w), w.label) for w in windows if w.is_hard]
    if not left:
        return None, None
    return min(left, key=lambda item: item[0])  # the first listed wins a tie: the month, then by budget id


def tightest_remaining(session: Session, tenant: Tenant, at: datetime | None = None) -> Decimal | None:
    """What the tenant may still spend now under its tightest hard tenant-wide budget (``tightest`` without
    an attribution); None: no such budget (unlimited)."""
    return tightest(session, tenant, at)[0]


def remaining(session: Session, tenant_id: int, budget: Decimal, at: datetime | None = None) -> Decimal:
    row = session.get(BudgetPeriod, (tenant_id, period_of(at or datetime.now(UTC))))
    used = (row.spent + row.reserved) if row is not None else Decimal(0)
    return max(Decimal(0), budget - used)


class PriceBook:
    """The price book (prices, plans, the tenants' plan history) in memory, re-read every ``ttl_s`` (prices
    change rarely; the hot path must not query).

    In a server, ``start()`` loads it and keeps it fresh from a background task (the query runs in a worker
    thread), so ``lookup`` never touches the database on the event loop. Without ``start()`` (the CLI, worker
    threads), ``lookup`` re-reads a stale table itself.
    """

    def __init__(self, engine: Engine, ttl_s: float = 30.0) -> None:
        self.engine = engine
        self.ttl_s = ttl_s
        self._index = PriceIndex(())
        self._loaded_at = float("-inf")
        self._refresher = Periodic("reading the price book", lambda: self.refresh(), ttl_s)

    def refresh(self) -> None:
        with Session(self.engine) as session:
            index = load_price_index(session)
            session.expunge_all()
        self._index = index  # one assignment: readers see the old book or the new one
        self._loaded_at = time.monotonic()

    async def start(self) -> None:
        """Load now, then refresh every ``ttl_s`` in the background until ``close()``."""
        await self._refresher.start()

    async def close(self) -> None:
        await self._refresher.close()

    def lookup(
        self, model: str, version: int | None, tier: str, at: datetime | None = None, tenant_id: int | None = None
    ) -> PriceLike | None:
        if not self._refresher.is_running and time.monotonic() - self._loaded_at > self.ttl_s:
            self.refresh()
        return self._index.lookup(model, version, tier, at or datetime.now(UTC), tenant_id)

    def cost(
        self,
        model: str,
        version: int | None,
        tier: str,
        tokens: Tokens,
        at: datetime | None = None,
        tenant_id: int | None = None,
    ) -> Rating:
        """``(price id, cost)`` for the tenant at ``at`` (now), or ``(None, None)`` when no price is in force."""
        return rate(self, model, version, tier, tokens, at or datetime.now(UTC), tenant_id)


def load_price_index(session: Session) -> PriceIndex:
    """The whole price book: every price, the tenants' plan history and the default plan, in three queries."""
    default = session.exec(select(PricePlan.id).where(col(PricePlan.name) == DEFAULT_PLAN)).first()
    return PriceIndex(session.exec(select(Price)).all(), session.exec(select(TenantPlan)).all(), default)
