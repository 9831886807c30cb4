"""Money controls: a tenant's budgets (tenant, key, project, end user), projects, price plan and overrides, and
prepaid credit; the price plans with their dated prices.

The forms call the services the ``/api`` money routes call (``controlplane.billing.budget_admin``, ``plans``,
``credit``, ``invoicing.add_price``), which check the input and write the audit record, so the console, the API and
the CLI refuse the same things with the same words. A refused form comes back (400) with the message under its
field; a change redirects to the page it was made on.
"""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

from litestar import Request, get, post
from litestar.response import Redirect, Template
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from console.auth import session_user
from console.pages.common import Form, errors_of, optional_int, optional_money, render, see_other, text, write_session
from controlplane.billing import budget_admin, credit, plans
from controlplane.billing.invoicing import PriceSpec, add_price, resolve_tenant
from controlplane.billing.plans import price_json
from controlplane.billing.scopes import PERIODS, SCOPES
from controlplane.storage.tables import ApiKey, Price, Tenant
from shared.errors import ApplicationError, ValidationError

TIERS = (("", "both"), ("edge", "edge"), ("cloud", "cloud"))
PRICE_FIELDS = frozenset(
    {"model", "version", "tier", "prompt_per_mtok", "completion_per_mtok", "cached_per_mtok", "per_call", "currency"}
    | {"effective_from"}
)
# The fields each form shows its errors under; an error about anything else goes above the form.
FIELDS = {
    "budgets": frozenset({"scope", "ref", "period", "amount"}),
    "projects": frozenset({"project", "key_id"}),
    "plan": frozenset({"plan", "effective_from"}),
    "overrides": PRICE_FIELDS,
    "credit": frozenset({"amount", "note", "below"}),
    "create": frozenset({"name", "description"}),
    "price": PRICE_FIELDS | {"plan"},
}


def _errors(form_name: str, exc: ApplicationError) -> dict[str, str]:
    errors = errors_of(exc)
    return errors if exc.param in FIELDS[form_name] else {"_form": exc.message}


def _when(form: dict[str, str], name: str) -> datetime | None:
    """A ``datetime-local`` field (UTC); empty: None (now)."""
    raw = text(form, name, max_length=32)
    if not raw:
        return None
    try:
        return datetime.fromisoformat(raw).replace(tzinfo=UTC)
    except ValueError:
        raise ValidationError(f"{name.replace('_', ' ')} must be a date and time", param=name) from None


def _money(form: dict[str, str], name: str, *, required: bool = True) -> Decimal | None:
    raw = form.get(name, "").strip()
    if not raw:
        if required:
            raise ValidationError(f"{name.replace('_', ' ')} is required", param=name)
        return None
    return budget_admin.parse_amount(raw, name)


def _price_spec(form: dict[str, str], *, plan: str | None, tenant: Tenant | None) -> PriceSpec:
    prompt = optional_money(form, "prompt_per_mtok")
    completion = optional_money(form, "completion_per_mtok")
    return PriceSpec(
        model=text(form, "model", max_length=128, required=True),
        prompt_per_mtok=prompt if prompt is not None else Decimal(0),
        completion_per_mtok=completion if completion is not None else Decimal(0),
        cached_per_mtok=optional_money(form, "cached_per_mtok"),
        version=optional_int(form, "version", minimum=1),
        tier=text(form, "tier", max_length=8) or None,
        currency=text(form, "currency", max_length=3) or (tenant.currency if tenant else "USD"),
        effective_from=_when(form, "effective_from"),
        per_call=optional_money(form, "per_call") or Decimal(0),
        plan=plan,
        tenant=tenant,
    )


# --- a tenant's money page --------------------------------------------------------------------------------------


def _tenant_page(
    request: Request[Any, Any, Any],
    db: Engine,
    name: str,
    status_code: int = 200,
    *,
    failed: str = "",
    form: dict[str, str] | None = None,
    errors: dict[str, str] | None = None,
) -> Template:
    """The page; ``failed`` names the form that was refused, which comes back with its values and errors."""
    now = datetime.now(UTC)
    with Session(db) as session:
        tenant = resolve_tenant(session, name)
        keys = session.exec(
            select(ApiKey).where(col(ApiKey.tenant_id) == tenant.id, col(ApiKey.revoked_at).is_(None))
        ).all()
        overrides = session.exec(
            select(Price)
            .where(col(Price.tenant_id) == tenant.id)
            .order_by(col(Price.model), col(Price.effective_from).desc())
        ).all()
        context = {
            "tenant": tenant,
            "plan": plans.plan_of(session, tenant, now),
            "plan_names": [p["name"] for p in plans.list_plans(session)],
            "overrides": [price_json(p) for p in overrides],
            "credit": credit.credit_view(session, tenant, limit=20),
            "budgets": budget_admin.list_budgets(session, tenant),
            "projects": budget_admin.list_projects(session, tenant),
            "keys": [(k.id, k.name or k.prefix, k.project_id) for k in sorted(keys, key=lambda k: k.id or 0)],
        }
    return render(
        request,
        "money.html.j2",
        status_code,
        scopes=SCOPES,
        periods=PERIODS,
        tiers=TIERS,
        failed=failed,
        form=form or {},
        errors=errors or {},
        **context,
    )


@get("/tenants/{name:str}/money", sync_to_thread=True)
def tenant_money(request: Request[Any, Any, Any], db: Engine, name: str) -> Template:
    """A tenant's budgets and their current windows, projects, plan and overrides, prepaid credit."""
    return _tenant_page(request, db, name)


def _change(
    request: Request[Any, Any, Any], db: Engine, name: str, form_name: str, data: dict[str, str], change: Any
) -> Template | Redirect:
    """Run ``change(session, tenant, actor)`` in one transaction; on bad input the page comes back with the form."""
    actor = session_user(request).actor
    try:
        with write_session(db) as session:
            tenant = resolve_tenant(session, name)
            change(session, tenant, actor)
    except ApplicationError as exc:
        if exc.status_code == 404 and exc.param == "tenant":
            raise
        status = exc.status_code  # 400, or 404/409 for a project, key or budget that is not there / taken
        return _tenant_page(request, db, name, status, failed=form_name, form=data, errors=_errors(form_name, exc))
    return see_other(f"/tenants/{name}/money#{form_name}")


@post("/tenants/{name:str}/money/budgets", sync_to_thread=True)
def budget_set(request: Request[Any, Any, Any], db: Engine, name: str, data: Form) -> Template | Redirect:
    """Create the budget of (scope, ref, period), or change its amount and kind (its spend stays)."""

    def change(session: Session, tenant: Tenant, actor: str) -> None:
        scope = text(data, "scope", max_length=8, required=True)
        budget_admin.set_budget(
            session,
            tenant,
            scope=scope,
            ref=text(data, "ref", max_length=256) or None,
            period=text(data, "period", max_length=8, required=True),
            amount=_money(data, "amount") or Decimal(0),
            is_hard=data.get("kind", "hard") != "soft",
            actor=actor,
        )

    return _change(request, db, name, "budgets", data, change)


@post("/tenants/{name:str}/money/budgets/{budget_id:int}/delete", sync_to_thread=True)
def budget_delete(request: Request[Any, Any, Any], db: Engine, name: str, budget_id: int, data: Form) -> Redirect:
    with write_session(db) as session:
        budget_admin.delete_budget(session, resolve_tenant(session, name), budget_id, session_user(request).actor)
    return see_other(f"/tenants/{name}/money#budgets")


@post("/tenants/{name:str}/money/projects", sync_to_thread=True)
def project_create(request: Request[Any, Any, Any], db: Engine, name: str, data: Form) -> Template | Redirect:
    def change(session: Session, tenant: Tenant, actor: str) -> None:
        budget_admin.create_project(session, tenant, text(data, "project", max_length=64, required=True), actor)

    return _change(request, db, name, "projects", data, change)


@post("/tenants/{name:str}/money/key-project", sync_to_thread=True)
def key_project(request: Request[Any, Any, Any], db: Engine, name: str, data: Form) -> Template | Redirect:
    """Put one of the tenant's keys in a project, or in none (an empty project)."""

    def change(session: Session, tenant: Tenant, actor: str) -> None:
        key_id = optional_int(data, "key_id", minimum=1, maximum=2**31 - 1)
        if key_id is None:
            raise ValidationError("key is required", param="key_id")
        project_name = text(data, "project", max_length=64)
        project = budget_admin.get_project(session, tenant, project_name) if project_name else None
        budget_admin.assign_key(session, tenant, key_id, project, actor)

    return _change(request, db, name, "projects", data, change)


@post("/tenants/{name:str}/money/plan", sync_to_thread=True)
def plan_assign(request: Request[Any, Any, Any], db: Engine, name: str, data: Form) -> Template | Redirect:
    """Put the tenant on a plan from a moment on (now, or later; never in the past)."""

    def change(session: Session, tenant: Tenant, actor: str) -> None:
        plan = plans.get_plan(session, text(data, "plan", max_length=64, required=True))
        plans.assign_plan(session, tenant, plan, effective_from=_when(data, "effective_from"), actor=actor)

    return _change(request, db, name, "plan", data, change)


@post("/tenants/{name:str}/money/overrides", sync_to_thread=True)
def override_add(request: Request[Any, Any, Any], db: Engine, name: str, data: Form) -> Template | Redirect:
    """A price of the tenant's own, in force before its plan's."""

    def change(session: Session, tenant: Tenant, actor: str) -> None:
        add_price(session, _price_spec(data, plan=None, tenant=tenant), actor=actor)

    return _change(request, db, name, "overrides", data, change)


@post("/tenants/{name:str}/money/top-ups", sync_to_thread=True)
def credit_top_up(request: Request[Any, Any, Any], db: Engine, name: str, data: Form) -> Template | Redirect:
    """Add prepaid credit (a ledger entry; the tenant becomes prepaid if it was not)."""

    def change(session: Session, tenant: Tenant, actor: str) -> None:
        amount = _money(data, "amount") or Decimal(0)
        credit.top_up(session, tenant, amount, note=text(data, "note", max_length=500), actor=actor)

    return _change(request, db, name, "credit", data, change)


@post("/tenants/{name:str}/money/low-balance", sync_to_thread=True)
def credit_low_balance(request: Request[Any, Any, Any], db: Engine, name: str, data: Form) -> Template | Redirect:
    """The balance below which a webhook and the console alert fire (empty: no alert)."""

    def change(session: Session, tenant: Tenant, actor: str) -> None:
        credit.set_low_balance(session, tenant, _money(data, "below", required=False), actor=actor)

    return _change(request, db, name, "credit", data, change)


# --- price plans ------------------------------------------------------------------------------------------------


def _plans_page(
    request: Request[Any, Any, Any],
    db: Engine,
    status_code: int = 200,
    *,
    failed: str = "",
    form: dict[str, str] | None = None,
    errors: dict[str, str] | None = None,
) -> Template:
    with Session(db) as session:
        listed = plans.list_plans(session)
    return render(
        request,
        "plans.html.j2",
        status_code,
        plans=listed,
        tiers=TIERS,
        now=datetime.now(UTC),
        failed=failed,
        form=form or {},
        errors=errors or {},
    )


@get("/billing/plans", sync_to_thread=True)
def plans_list(request: Request[Any, Any, Any], db: Engine) -> Template:
    """Every price plan with its prices by effective date (its versions) and how many tenants are on it."""
    return _plans_page(request, db)


@post("/billing/plans", sync_to_thread=True)
def plan_create(request: Request[Any, Any, Any], db: Engine, data: Form) -> Template | Redirect:
    try:
        with write_session(db) as session:
            plan = plans.create_plan(
                session,
                text(data, "name", max_length=64, required=True),
                text(data, "description", max_length=500),
                session_user(request).actor,
            )
            plan_name = plan.name
    except ApplicationError as exc:
        return _plans_page(request, db, exc.status_code, failed="create", form=data, errors=_errors("create", exc))
    return see_other(f"/billing/plans#plan-{plan_name}")


@post("/billing/plans/prices", sync_to_thread=True)
def plan_price_add(request: Request[Any, Any, Any], db: Engine, data: Form) -> Template | Redirect:
    """A price in a plan from its effective date on: the plan's next version (earlier usage keeps its price)."""
    try:
        plan_name = text(data, "plan", max_length=64, required=True)
        with write_session(db) as session:
            add_price(session, _price_spec(data, plan=plan_name, tenant=None), actor=session_user(request).actor)
    except ApplicationError as exc:
        return _plans_page(request, db, exc.status_code, failed="price", form=data, errors=_errors("price", exc))
    return see_other(f"/billing/plans#plan-{plan_name}")


HANDLERS = [
    tenant_money,
    budget_set,
    budget_delete,
    project_create,
    key_project,
    plan_assign,
    override_add,
    credit_top_up,
    credit_low_balance,
    plans_list,
    plan_create,
    plan_price_add,
]
