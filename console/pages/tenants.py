"""Tenants: list with search, create, edit limits and budget, usage to date, budget alerts."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

from litestar import Request, get, post
from litestar.plugins.htmx import HTMXRequest
from litestar.response import Redirect, Template
from sqlalchemy import func, or_
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from console.auth import session_user
from console.pages import changes
from console.pages.common import (
    Form,
    errors_of,
    like,
    optional_int,
    optional_money,
    paginate,
    render,
    see_other,
    text,
    write_session,
)
from controlplane.billing import budget_admin, credit, plans
from controlplane.billing.ledger import cost_total, month_spend
from controlplane.billing.pricing import period_of
from controlplane.storage.tables import ApiKey, BudgetAlert, BudgetPeriod, Tenant, UsageRecord
from controlplane.tenancy import service as tenancy
from shared.errors import ApplicationError


@dataclass(frozen=True, slots=True)
class Usage:
    requests: int = 0
    tokens: int = 0
    cost: Decimal = Decimal(0)


def usage_by_tenant(session: Session, tenant_ids: list[int], since: datetime | None = None) -> dict[int, Usage]:
    query = select(
        UsageRecord.tenant_id,
        func.count(),
        func.sum(UsageRecord.prompt_tokens + UsageRecord.completion_tokens),
        cost_total(),
    ).where(col(UsageRecord.tenant_id).in_(tenant_ids))
    if since is not None:
        query = query.where(col(UsageRecord.occurred_at) >= since)
    rows = session.exec(query.group_by(col(UsageRecord.tenant_id))).all()
    return {tid: Usage(int(n), int(tokens or 0), cost) for tid, n, tokens, cost in rows}


def _month_start(now: datetime) -> datetime:
    return now.replace(day=1, hour=0, minute=0, second=0, microsecond=0)


def _edit_from(form: dict[str, str], *, is_new: bool = False) -> changes.TenantEdit:
    return changes.TenantEdit(
        display_name=text(form, "display_name", max_length=200),
        is_active=is_new or form.get("is_active", "") in ("on", "true", "1"),
        monthly_budget=optional_money(form, "monthly_budget"),
        requests_per_minute=optional_int(form, "requests_per_minute", minimum=1),
        tokens_per_minute=optional_int(form, "tokens_per_minute", minimum=1),
        max_concurrent=optional_int(form, "max_concurrent", minimum=1, maximum=100_000),
    )


@get("/tenants", sync_to_thread=True)
def tenants_list(request: HTMXRequest, db: Engine, q: str = "", page: int = 1) -> Template:
    """Tenants by name; ``q`` searches name and display name. HTMX searches get the rows alone."""
    q = q.strip()[:64]
    query = select(Tenant).order_by(Tenant.name)
    if q:
        query = query.where(
            or_(
                func.lower(Tenant.name).like(like(q), escape="\\"),
                func.lower(Tenant.display_name).like(like(q), escape="\\"),
            )
        )
    with Session(db) as session:
        rows, info = paginate(session, query, page, {"q": q})
        usage = usage_by_tenant(session, [t.id for t in rows if t.id], _month_start(datetime.now(UTC)))
    # Search as you type swaps the rows in (the page pushes the URL, so a reload shows the same list).
    template = "partials/tenant_rows.html.j2" if request.htmx else "tenants.html.j2"
    return render(request, template, tenants=rows, page=info, q=q, usage=usage)


@get("/tenants/new", sync_to_thread=False)
def tenant_new(request: Request[Any, Any, Any]) -> Template:
    return render(request, "tenant_form.html.j2", tenant=None, form={}, errors={})


@post("/tenants", sync_to_thread=True)
def tenant_create(request: Request[Any, Any, Any], db: Engine, data: Form) -> Template | Redirect:
    """Create a tenant; a bad field re-renders the form with the message under it."""
    user = session_user(request)
    try:
        name = text(data, "name", max_length=64, required=True)
        with write_session(db) as session:
            tenant = changes.create_tenant(session, name, _edit_from(data, is_new=True), actor=user.actor)
    except ApplicationError as exc:
        return render(request, "tenant_form.html.j2", 400, tenant=None, form=data, errors=errors_of(exc))
    return see_other(f"/tenants/{tenant.name}")


@get("/tenants/{name:str}", sync_to_thread=True)
def tenant_detail(request: Request[Any, Any, Any], db: Engine, name: str) -> Template:
    """A tenant: limits, budget and this month's spend, usage to date, alerts and keys."""
    now = datetime.now(UTC)
    with Session(db) as session:
        tenant = tenancy.get_tenant(session, name)
        assert tenant.id is not None
        period = period_of(now)
        spent = month_spend(session, tenant.id, period, now=now)  # the one spend figure (billing, invoice draft)
        month = usage_by_tenant(session, [tenant.id], _month_start(now)).get(tenant.id, Usage())
        total = usage_by_tenant(session, [tenant.id]).get(tenant.id, Usage())
        counted = session.get(BudgetPeriod, (tenant.id, period))
        alerts = list(
            session.exec(
                select(BudgetAlert)
                .where(BudgetAlert.tenant_id == tenant.id, BudgetAlert.period == period)
                .order_by(col(BudgetAlert.threshold).desc())
            )
        )
        keys = [
            (k, tenant.name)
            for k in session.exec(select(ApiKey).where(ApiKey.tenant_id == tenant.id).order_by(col(ApiKey.id).desc()))
        ]
        money = {
            "plan": plans.plan_of(session, tenant, now),
            "credit": credit.credit_view(session, tenant, limit=10),
            "budgets": budget_admin.list_budgets(session, tenant),
            "projects": budget_admin.list_projects(session, tenant),
        }
    return render(
        request,
        "tenant.html.j2",
        tenant=tenant,
        period=period,
        month=month,
        total=total,
        spent=spent,
        # What the monthly budget's enforcement counted (holds settled, device ingest): shown as that, not as spend.
        budget_counted=counted.spent if counted is not None and tenant.monthly_budget is not None else None,
        alert=alerts[0] if alerts else None,
        keys=keys,
        now=now,
        money=money,
    )


@get("/tenants/{name:str}/edit", sync_to_thread=True)
def tenant_edit(request: Request[Any, Any, Any], db: Engine, name: str) -> Template:
    with Session(db) as session:
        tenant = tenancy.get_tenant(session, name)
    form = {
        "display_name": tenant.display_name,
        "is_active": "on" if tenant.is_active else "",
        "monthly_budget": "" if tenant.monthly_budget is None else f"{tenant.monthly_budget:f}",
        "requests_per_minute": str(tenant.requests_per_minute or ""),
        "tokens_per_minute": str(tenant.tokens_per_minute or ""),
        "max_concurrent": str(tenant.max_concurrent or ""),
    }
    return render(request, "tenant_form.html.j2", tenant=tenant, form=form, errors={})


@post("/tenants/{name:str}/edit", sync_to_thread=True)
def tenant_update(request: Request[Any, Any, Any], db: Engine, name: str, data: Form) -> Template | Redirect:
    """Change limits, budget, display name or whether the tenant is active."""
    user = session_user(request)
    try:
        edit = _edit_from(data)
        with write_session(db) as session:
            changes.update_tenant(session, name, edit, actor=user.actor)
    except ApplicationError as exc:
        if exc.status_code == 404:
            raise
        with Session(db) as session:
            tenant = tenancy.get_tenant(session, name)
        return render(request, "tenant_form.html.j2", 400, tenant=tenant, form=data, errors=errors_of(exc))
    return see_other(f"/tenants/{name}")


HANDLERS = [tenants_list, tenant_new, tenant_create, tenant_detail, tenant_edit, tenant_update]
