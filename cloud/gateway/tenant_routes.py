"""The caller's tenant: its budget this month, its webhook URL for tenant events, and their delivery log.

- ``GET /v1/budget``: the monthly budget, settled spend, open reservations, what remains, and the alerts fired.
- ``GET /v1/webhook`` / ``PUT /v1/webhook`` ``{"url": ...}``: where tenant events (``budget.threshold``,
  ``credit.low_balance``) are POSTed, signed with the tenant's webhook secret (``POST /v1/webhook-secret``);
  ``{"url": null}`` stops them.
- ``GET /v1/webhook-deliveries?event=&limit=``: the latest tenant event deliveries with every attempt.
"""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

from litestar import get, put
from litestar.params import Parameter
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from cloud.gateway.budget_watch import BUDGET_THRESHOLD, CREDIT_LOW_BALANCE
from cloud.gateway.jobs import MAX_LIST_LIMIT, JobSettings
from cloud.gateway.webhooks import MAX_URL_LENGTH, WebhookStore, attempt_json, validate_webhook_url
from cloud.serving.completions import Caller
from controlplane.billing.budgets import remaining
from controlplane.billing.pricing import period_of
from controlplane.storage.tables import BudgetAlert, BudgetPeriod, Tenant
from shared.http import error_responses


class WebhookEndpoint(BaseModel):
    model_config = ConfigDict(extra="forbid")

    url: str | None = Field(max_length=MAX_URL_LENGTH, description="http(s) URL; null: send no tenant events")


def _endpoint_json(webhooks: WebhookStore, tenant_id: int) -> dict[str, Any]:
    return {
        "object": "webhook",
        "url": webhooks.tenant_url(tenant_id),
        "has_secret": webhooks.has_secret(tenant_id),
        "events": [BUDGET_THRESHOLD, CREDIT_LOW_BALANCE],
    }


@get("/v1/webhook", sync_to_thread=True, responses=error_responses(401))
def get_webhook(webhooks: WebhookStore, caller: Caller) -> dict[str, Any]:
    """The tenant's webhook URL for tenant events, and whether a signing secret is set."""
    return _endpoint_json(webhooks, caller.tenant.id or 0)


@put("/v1/webhook", sync_to_thread=True, responses=error_responses(400, 401, 413))
def set_webhook(
    webhooks: WebhookStore, job_settings: JobSettings, caller: Caller, data: WebhookEndpoint
) -> dict[str, Any]:
    """Set (or, with ``null``, clear) the tenant's webhook URL. Events are only sent once a secret exists."""
    url = data.url
    if url is not None:
        url = validate_webhook_url(url, allow_private=job_settings.webhook_allow_private_networks)
    webhooks.set_tenant_url(caller.tenant.id or 0, url)
    return _endpoint_json(webhooks, caller.tenant.id or 0)


@get("/v1/webhook-deliveries", sync_to_thread=True, responses=error_responses(400, 401))
def list_event_deliveries(
    webhooks: WebhookStore,
    caller: Caller,
    event: str | None = Parameter(default=None, max_length=32, description="only this event type"),
    limit: int = Parameter(default=20, ge=1, le=MAX_LIST_LIMIT),
) -> dict[str, Any]:
    """The tenant's latest event deliveries (jobs' are under ``/v1/jobs/{id}/deliveries``), newest first."""
    return {
        "object": "list",
        "data": [
            {
                "object": "webhook_delivery",
                "id": d.id,
                "event": d.event,
                "url": d.url,
                "status": d.status,
                "attempts": d.attempts,
                "created_at": int(d.created_at.timestamp()),
                "payload": d.payload,
                "attempt_log": [attempt_json(a) for a in attempts],
            }
            for d, attempts in webhooks.events(caller.tenant.id or 0, event, limit)
        ],
    }


@get("/v1/budget", sync_to_thread=True, responses=error_responses(401))
def get_budget(db: Engine, caller: Caller) -> dict[str, Any]:
    """This month's budget for the caller's tenant: spend, reservations, what remains, and the alerts fired."""
    tenant_id = caller.tenant.id or 0
    period = period_of(datetime.now(UTC))
    with Session(db) as session:
        tenant = session.get(Tenant, tenant_id)
        budget = tenant.monthly_budget if tenant is not None else None
        row = session.get(BudgetPeriod, (tenant_id, period))
        alerts = session.exec(
            select(BudgetAlert)
            .where(BudgetAlert.tenant_id == tenant_id, BudgetAlert.period == period)
            .order_by(col(BudgetAlert.threshold))
        ).all()
        left = remaining(session, tenant_id, budget) if budget is not None else None
    return {
        "object": "budget",
        "period": period,
        "currency": tenant.currency if tenant is not None else "USD",
        "budget": _money(budget),
        "spent": _money(row.spent if row is not None else Decimal(0)),
        "reserved": _money(row.reserved if row is not None else Decimal(0)),
        "remaining": _money(left),
        "alerts": [
            {"threshold": a.threshold, "spent": _money(a.spent), "fired_at": int(a.fired_at.timestamp())}
            for a in alerts
        ],
    }


MONEY_PLACES = Decimal("0.000001")  # the database's scale (NUMERIC(18, 6))


def _money(value: Decimal | None) -> str | None:
    """Money as a decimal string at the database's scale (exact; a JSON number would be a float)."""
    return None if value is None else str((value + 0).quantize(MONEY_PLACES))  # + 0: no "-0"


TENANT_ROUTES = [get_webhook, set_webhook, list_event_deliveries, get_budget]
