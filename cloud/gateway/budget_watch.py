"""Budget upkeep in the cloud process: threshold alerts after spend is settled, and the sweeper that releases
reservations whose process died.

Alerts: when a tenant's settled spend in a month reaches 80% and then 100% of its monthly budget, a
``budget_alert`` record is written (its unique key on tenant, period and threshold makes each fire once per
period, even when replicas settle concurrently) and, in the same transaction, a signed ``budget.threshold``
webhook delivery is queued for the tenant's webhook URL when it has one (``cloud.gateway.webhooks``: retried, logged).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError
from sqlmodel import Session

from cloud.gateway.webhooks import WebhookStore
from controlplane.billing import credit
from controlplane.billing.budgets import reclaim_expired, thresholds_reached
from controlplane.billing.ledger import reconcile_checkpoints
from controlplane.billing.pricing import PriceLookup
from controlplane.storage.tables import BudgetAlert, CreditAccount, Tenant
from shared.periodic import Periodic

logger = logging.getLogger(__name__)

BUDGET_THRESHOLD = "budget.threshold"
CREDIT_LOW_BALANCE = "credit.low_balance"


def alert_payload(alert: BudgetAlert, tenant: Tenant) -> dict[str, Any]:
    """The ``budget.threshold`` event's body."""
    return {
        "id": f"balert_{alert.id}",
        "type": BUDGET_THRESHOLD,
        "created": int(alert.fired_at.timestamp()),
        "data": {
            "tenant": tenant.name,
            "period": alert.period,
            "threshold": alert.threshold,
            "spent": str(alert.spent),
            "budget": str(alert.budget),
            "currency": tenant.currency,
        },
    }


class BudgetAlerts:
    """Fires each threshold once per tenant and period. Thresholds already fired are remembered in memory, so
    the common case (nothing new reached) costs no query."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.notify: Callable[[], None] | None = None  # wakes the webhook dispatcher (set by the app)
        self._fired: set[tuple[int, str, int]] = set()

    def check(self, tenant_id: int, period: str, spent: Decimal, budget: Decimal) -> list[BudgetAlert]:
        """Record the thresholds ``spent`` reached that had not fired yet; the alerts this call fired. Synchronous
        (SQL): call it from a worker thread."""
        fired: list[BudgetAlert] = []
        for threshold in thresholds_reached(spent, budget):
            key = (tenant_id, period, threshold)
            if key in self._fired:
                continue
            alert = self._record(tenant_id, period, threshold, spent, budget)
            self._fired.add(key)
            if alert is not None:
                fired.append(alert)
        return fired

    def _record(
        self, tenant_id: int, period: str, threshold: int, spent: Decimal, budget: Decimal
    ) -> BudgetAlert | None:
        with Session(self.engine, expire_on_commit=False) as session:
            tenant = session.get(Tenant, tenant_id)
            if tenant is None:
                return None
            alert = BudgetAlert(tenant_id=tenant_id, period=period, threshold=threshold, spent=spent, budget=budget)
            session.add(alert)
            try:
                session.flush()
            except IntegrityError:  # another request or replica fired it first
                session.rollback()
                return None
            if tenant.webhook_url:
                WebhookStore.enqueue_event(
                    session, tenant_id, tenant.webhook_url, BUDGET_THRESHOLD, alert_payload(alert, tenant)
                )
            session.commit()
        logger.info("tenant %s reached %d%% of its %s budget for %s", tenant_id, threshold, budget, period)
        return alert

    def check_credit(self, tenant_id: int) -> bool:
        """Fire the low-balance alert when the tenant's credit fell below its line (once until the next top-up):
        a ``credit.low_balance`` webhook to the tenant's URL; whether this call fired it. Synchronous (SQL)."""
        with Session(self.engine, expire_on_commit=False) as session:
            account = credit.claim_low_alert(session, tenant_id)
            tenant = session.get(Tenant, tenant_id)
            if account is None or tenant is None:
                session.rollback()
                return False
            if tenant.webhook_url:
                payload = low_balance_payload(account, tenant)
                WebhookStore.enqueue_event(session, tenant_id, tenant.webhook_url, CREDIT_LOW_BALANCE, payload)
            session.commit()
        logger.info("tenant %s's prepaid credit fell below %s", tenant_id, account.low_balance)
        return True

    async def after_credit(self, tenant_id: int) -> None:
        """``check_credit`` off the event loop after a request drew on credit, then wake the dispatcher."""
        try:
            fired = await asyncio.to_thread(self.check_credit, tenant_id)
        except Exception:  # an alert is never worth a request's usage record; the next settle tries again
            logger.exception("checking the credit balance of tenant %s failed", tenant_id)
            return
        if fired and self.notify is not None:
            self.notify()

    async def after_settle(self, tenant_id: int, period: str, spent: Decimal, budget: Decimal) -> None:
        """``check`` off the event loop (only when a threshold may be new), then wake the dispatcher."""
        if all((tenant_id, period, t) in self._fired for t in thresholds_reached(spent, budget)):
            return
        try:
            fired = await asyncio.to_thread(self.check, tenant_id, period, spent, budget)
        except Exception:  # an alert is never worth a request's usage record; the next settle tries again
            logger.exception("recording budget alerts for tenant %s failed", tenant_id)
            return
        if fired and self.notify is not None:
            self.notify()


def low_balance_payload(account: CreditAccount, tenant: Tenant) -> dict[str, Any]:
    """The ``credit.low_balance`` event's body."""
    fired_at = account.low_alerted_at or datetime.now(UTC)
    return {
        "id": f"clow_{tenant.id}_{int(fired_at.timestamp())}",
        "type": CREDIT_LOW_BALANCE,
        "created": int(fired_at.timestamp()),
        "data": {
            "tenant": tenant.name,
            "balance": str(account.balance),
            "low_balance": str(account.low_balance),
            "currency": tenant.currency,
        },
    }


class ReservationSweeper:
    """Every ``interval_s`` (and at start-up), bills the usage checkpoints of streams whose process died
    (``controlplane.billing.ledger.reconcile_checkpoints``: what was streamed is billed, the rest of the reservation
    released), then releases the budget reservations whose lease expired (``controlplane.billing.budgets``)."""

    def __init__(self, engine: Engine, interval_s: float, prices: PriceLookup | None = None) -> None:
        self.engine = engine
        self.interval_s = interval_s
        self.prices = prices
        self.num_released = 0
        self.num_reconciled = 0
        self._sweeper = Periodic("releasing expired budget reservations", lambda: self.sweep(), interval_s)

    def sweep(self) -> None:
        self.num_reconciled += reconcile_checkpoints(self.engine, self.prices)
        self.num_released += reclaim_expired(self.engine)

    async def start(self) -> None:
        await self._sweeper.start(wait_for_first=False)

    async def close(self) -> None:
        await self._sweeper.close()
