"""Managing scoped budgets and projects: the service the console API and ``tierline billing`` share.

Every change writes an audit record in the caller's transaction. Input is checked here, so the API and the CLI
refuse the same things with the same words (``ValidationError`` / ``NotFoundError`` naming the field).
"""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal, InvalidOperation
from typing import Any

from sqlmodel import Session, col, select

from controlplane.billing.scopes import EVERY_USER, MAX_SUBJECT_LEN, PERIODS, SCOPES, describe, window_of
from controlplane.storage.audit import audit
from controlplane.storage.tables import ApiKey, Budget, BudgetWindow, Project, Tenant
from controlplane.storage.types import from_micros, to_micros
from shared.errors import ConflictError, NotFoundError, ValidationError

MAX_AMOUNT = Decimal(10) ** 12


def parse_amount(value: object, param: str = "amount") -> Decimal:
    """A non-negative amount of money with at most 6 decimals, from a string or an int (never a float)."""
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise ValidationError(f'{param}: give the amount as a string, e.g. "12.50"', param=param)
    try:
        amount = Decimal(str(value).strip())
    except InvalidOperation:
        raise ValidationError(f"{param}: {value!r} is not an amount", param=param) from None
    if not amount.is_finite() or amount < 0 or amount >= MAX_AMOUNT:
        raise ValidationError(f"{param}: must be at least 0 and below {MAX_AMOUNT}", param=param)
    if amount != amount.quantize(Decimal("0.000001")):
        raise ValidationError(f"{param}: at most 6 decimal places", param=param)
    return amount


# --- projects ---------------------------------------------------------------------------------------------------


def project_view(project: Project, key_ids: list[int]) -> dict[str, Any]:
    return {"id": project.id, "name": project.name, "key_ids": key_ids, "created_at": project.created_at.isoformat()}


def get_project(session: Session, tenant: Tenant, name_or_id: str) -> Project:
    stmt = select(Project).where(col(Project.tenant_id) == tenant.id)
    project = session.exec(stmt.where(col(Project.name) == name_or_id)).first()
    if project is None and name_or_id.isdigit() and len(name_or_id) < 10:
        project = session.exec(stmt.where(col(Project.id) == int(name_or_id))).first()
    if project is None:
        raise NotFoundError(f"tenant {tenant.name!r} has no project {name_or_id!r}", param="project")
    return project


def create_project(session: Session, tenant: Tenant, name: str, actor: str) -> Project:
    name = name.strip()
    if not name or len(name) > 64 or not name.isprintable():
        raise ValidationError("name: 1 to 64 printable characters", param="name")
    taken = session.exec(select(Project).where(col(Project.tenant_id) == tenant.id, col(Project.name) == name))
    if taken.first() is not None:
        raise ConflictError(f"tenant {tenant.name!r} already has a project {name!r}", param="name")
    project = Project(tenant_id=tenant.id or 0, name=name)
    session.add(project)
    session.flush()
    audit(session, actor, "project.create", f"project/{project.id}", None, {"tenant": tenant.name, "name": name})
    return project


def list_projects(session: Session, tenant: Tenant) -> list[dict[str, Any]]:
    projects = session.exec(select(Project).where(col(Project.tenant_id) == tenant.id).order_by(col(Project.id)))
    keys = session.exec(select(ApiKey).where(col(ApiKey.tenant_id) == tenant.id, col(ApiKey.project_id).is_not(None)))
    members: dict[int, list[int]] = {}
    for k in keys:
        members.setdefault(k.project_id or 0, []).append(k.id or 0)
    return [project_view(p, sorted(members.get(p.id or 0, []))) for p in projects]


def assign_key(session: Session, tenant: Tenant, key_id: int, project: Project | None, actor: str) -> ApiKey:
    """Put one of the tenant's keys in ``project`` (None: in no project)."""
    key = session.get(ApiKey, key_id)
    if key is None or key.tenant_id != tenant.id:
        raise NotFoundError(f"tenant {tenant.name!r} has no API key {key_id}", param="key_id")
    before = {"project_id": key.project_id}
    key.project_id = project.id if project is not None else None
    session.add(key)
    audit(session, actor, "api_key.project", f"api_key/{key_id}", before, {"project_id": key.project_id})
    return key


# --- budgets ----------------------------------------------------------------------------------------------------


def _checked_ref(session: Session, tenant: Tenant, scope: str, ref: str | None) -> str:
    if scope not in SCOPES:
        raise ValidationError(f"scope: {scope!r} is not one of {', '.join(SCOPES)}", param="scope")
    ref = (ref or "").strip()
    if scope == "tenant":
        if ref:
            raise ValidationError("ref: a tenant budget takes no ref", param="ref")
        return ""
    if not ref:
        raise ValidationError(f"ref: a {scope} budget needs a ref", param="ref")
    if scope == "key":
        key = session.get(ApiKey, int(ref)) if ref.isdigit() and len(ref) < 10 else None
        if key is None or key.tenant_id != tenant.id:
            raise NotFoundError(f"tenant {tenant.name!r} has no API key {ref}", param="ref")
        return str(key.id)
    if scope == "project":
        return str(get_project(session, tenant, ref).id)
    if len(ref) > MAX_SUBJECT_LEN:
        raise ValidationError(f"ref: an end user id is at most {MAX_SUBJECT_LEN} characters", param="ref")
    return ref


def set_budget(
    session: Session,
    tenant: Tenant,
    *,
    scope: str,
    ref: str | None,
    period: str,
    amount: Decimal,
    is_hard: bool,
    actor: str,
) -> Budget:
    """Create the budget of ``(scope, ref, period)``, or change its amount and kind (its spend stays)."""
    if period not in PERIODS:
        raise ValidationError(f"period: {period!r} is not one of {', '.join(PERIODS)}", param="period")
    ref = _checked_ref(session, tenant, scope, ref)
    budget = session.exec(
        select(Budget).where(
            col(Budget.tenant_id) == tenant.id,
            col(Budget.scope) == scope,
            col(Budget.ref) == ref,
            col(Budget.period) == period,
        )
    ).first()
    before = None if budget is None else {"amount": str(budget.amount), "is_hard": budget.is_hard}
    if budget is None:
        budget = Budget(tenant_id=tenant.id or 0, scope=scope, ref=ref, period=period, amount=amount, is_hard=is_hard)
    else:
        budget.amount, budget.is_hard = amount, is_hard
    session.add(budget)
    session.flush()
    after = {"tenant": tenant.name, "scope": scope, "ref": ref, "period": period, "amount": str(amount)}
    audit(session, actor, "budget.set", f"budget/{budget.id}", before, {**after, "is_hard": is_hard})
    return budget


def get_budget(session: Session, tenant: Tenant, budget_id: int) -> Budget:
    budget = session.get(Budget, budget_id)
    if budget is None or budget.tenant_id != tenant.id:
        raise NotFoundError(f"tenant {tenant.name!r} has no budget {budget_id}", param="budget_id")
    return budget


def delete_budget(session: Session, tenant: Tenant, budget_id: int, actor: str) -> None:
    budget = get_budget(session, tenant, budget_id)
    before = budget_view(session, budget)
    for window in session.exec(select(BudgetWindow).where(col(BudgetWindow.budget_id) == budget_id)):
        session.delete(window)
    session.flush()
    session.delete(budget)
    audit(session, actor, "budget.delete", f"budget/{budget_id}", before, None)


def _text(amount: Decimal) -> str:
    """Money as stored: six decimals, whether it was read back or just set."""
    return str(from_micros(to_micros(amount)))


def budget_view(session: Session, budget: Budget, at: datetime | None = None) -> dict[str, Any]:
    """A budget with its current window's spend (for a per-user budget: the sum over its end users)."""
    window = window_of(budget.period, at or datetime.now(UTC))
    rows = session.exec(
        select(BudgetWindow).where(col(BudgetWindow.budget_id) == budget.id, col(BudgetWindow.window) == window)
    ).all()
    spent = sum((r.spent for r in rows), Decimal(0))
    reserved = sum((r.reserved for r in rows), Decimal(0))
    view: dict[str, Any] = {
        "id": budget.id,
        "scope": budget.scope,
        "ref": budget.ref,
        "period": budget.period,
        "amount": _text(budget.amount),
        "is_hard": budget.is_hard,
        "name": describe(budget, _project_name(session, budget)),
        "window": window,
        "spent": _text(spent),
        "reserved": _text(reserved),
    }
    if budget.scope == "user" and budget.ref == EVERY_USER:
        view["end_users"] = len(rows)
        view["end_users_over"] = sum(1 for r in rows if r.spent >= budget.amount)
    else:
        view["remaining"] = _text(max(Decimal(0), budget.amount - spent - reserved))
    return view


def _project_name(session: Session, budget: Budget) -> str | None:
    if budget.scope != "project" or not budget.ref.isdigit():
        return None
    project = session.get(Project, int(budget.ref))
    return project.name if project is not None else None


def list_budgets(session: Session, tenant: Tenant) -> list[dict[str, Any]]:
    budgets = session.exec(select(Budget).where(col(Budget.tenant_id) == tenant.id).order_by(col(Budget.id)))
    return [budget_view(session, b) for b in budgets]
