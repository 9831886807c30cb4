"""Monthly budgets on the hot path: reserve the worst case before generating, settle the actual cost after.

A reservation is one conditional UPDATE, ``spent + reserved + amount <= budget``, which SQLite (one writer
at a time) and PostgreSQL (the row is re-checked under its lock) both apply atomically. So the committed
total (settled plus reserved) never exceeds the budget, however many requests race; a request's actual cost
is at most what it reserved, so settled spend never exceeds it either.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal

from sqlalchemy import update
from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError
from sqlmodel import Session, col, select

from shared.errors import ApplicationError
from shared.pricing import PriceLike, Tokens, cost, period_of, price_for
from shared.storage.models import BudgetPeriod, Price


class BudgetExceededError(ApplicationError):
    """OpenAI's shape for an exhausted quota."""

    status_code = 429
    error_type = "insufficient_quota"
    code = "insufficient_quota"


@dataclass(frozen=True, slots=True)
class Reservation:
    tenant_id: int
    period: str
    amount: Decimal


def _ensure_row(engine: Engine, tenant_id: int, period: str) -> None:
    with Session(engine) as session:
        if session.get(BudgetPeriod, (tenant_id, period)) is not None:
            return
        session.add(BudgetPeriod(tenant_id=tenant_id, period=period))
        try:
            session.commit()
        except IntegrityError:  # a concurrent request created it first
            session.rollback()


def reserve(
    engine: Engine, tenant_id: int, budget: Decimal, amount: Decimal, at: datetime | None = None
) -> Reservation:
    """Reserve ``amount`` of the tenant's monthly ``budget`` or raise ``BudgetExceededError``."""
    period = period_of(at or datetime.now(UTC))
    _ensure_row(engine, tenant_id, period)
    with Session(engine) as session:
        result = session.execute(
            update(BudgetPeriod)
            .where(
                col(BudgetPeriod.tenant_id) == tenant_id,
                col(BudgetPeriod.period) == period,
                col(BudgetPeriod.spent) + col(BudgetPeriod.reserved) + amount <= budget,
            )
            .values(reserved=col(BudgetPeriod.reserved) + amount)
        )
        session.commit()
    if result.rowcount != 1:  # type: ignore[attr-defined]
        raise BudgetExceededError(
            f"the tenant's monthly budget ({budget}) cannot cover this request's worst case ({amount}); "
            "lower max_tokens or raise the budget"
        )
    return Reservation(tenant_id, period, amount)


def settle(engine: Engine, reservation: Reservation, actual: Decimal) -> None:
    """Release the reservation and add what the request really cost (never more than it reserved)."""
    actual = min(actual, reservation.amount)
    with Session(engine) as session:
        session.execute(
            update(BudgetPeriod)
            .where(col(BudgetPeriod.tenant_id) == reservation.tenant_id, col(BudgetPeriod.period) == reservation.period)
            .values(
                reserved=col(BudgetPeriod.reserved) - reservation.amount,
                spent=col(BudgetPeriod.spent) + actual,
            )
        )
        session.commit()


def add_spend(session: Session, tenant_id: int, at: datetime, amount: Decimal) -> None:
    """Spend that was not reserved (edge usage arriving at sync), in the caller's transaction."""
    period = period_of(at)
    row = session.get(BudgetPeriod, (tenant_id, period))
    if row is None:
        session.add(BudgetPeriod(tenant_id=tenant_id, period=period, spent=amount))
        session.flush()
        return
    session.execute(
        update(BudgetPeriod)
        .where(col(BudgetPeriod.tenant_id) == tenant_id, col(BudgetPeriod.period) == period)
        .values(spent=col(BudgetPeriod.spent) + amount)
    )


def remaining(session: Session, tenant_id: int, budget: Decimal, at: datetime | None = None) -> Decimal:
    row = session.get(BudgetPeriod, (tenant_id, period_of(at or datetime.now(UTC))))
    used = (row.spent + row.reserved) if row is not None else Decimal(0)
    return max(Decimal(0), budget - used)


class PriceBook:
    """The price table in memory, re-read every ``ttl_s`` (prices change rarely; the hot path must not query)."""

    def __init__(self, engine: Engine, ttl_s: float = 30.0) -> None:
        self.engine = engine
        self.ttl_s = ttl_s
        self._prices: list[Price] = []
        self._loaded_at = float("-inf")

    def refresh(self) -> None:
        with Session(self.engine) as session:
            self._prices = list(session.exec(select(Price)))
            session.expunge_all()
        self._loaded_at = time.monotonic()

    def lookup(self, model: str, version: int | None, tier: str, at: datetime | None = None) -> PriceLike | None:
        if time.monotonic() - self._loaded_at > self.ttl_s:
            self.refresh()
        return price_for(self._prices, model, version, tier, at or datetime.now(UTC))

    def cost(self, model: str, version: int | None, tier: str, tokens: Tokens) -> tuple[int | None, Decimal | None]:
        """``(price id, cost)``, or ``(None, None)`` when no price is in force (the record is flagged)."""
        price = self.lookup(model, version, tier)
        if price is None:
            return None, None
        return getattr(price, "id", None), cost(price, tokens)
