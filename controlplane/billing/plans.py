"""Price plans: named sets of prices, the tenants on them, and per-tenant overrides (the service the console
API and ``tierline billing plans`` share).

A plan's versions are its prices' effective dates: a price added with ``effective_from`` tomorrow changes what
the plan charges from tomorrow on, and nothing before. A tenant is on a plan from a moment on (``tenant_plan``
rows, never rewritten), so moving a tenant to another plan re-rates nothing already stored.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlmodel import Session, col, select

from controlplane.billing.pricing import DEFAULT_PLAN
from controlplane.storage.audit import audit
from controlplane.storage.tables import Price, PricePlan, Tenant, TenantPlan
from controlplane.storage.types import as_utc
from shared.errors import ConflictError, NotFoundError, ValidationError


def get_plan(session: Session, name: str) -> PricePlan:
    plan = session.exec(select(PricePlan).where(col(PricePlan.name) == name)).first()
    if plan is None:
        raise NotFoundError(f"no price plan {name!r}", param="plan")
    return plan


def default_plan(session: Session) -> PricePlan:
    """The plan named ``default`` (the migration creates it; a schema made without migrations gets it here)."""
    plan = session.exec(select(PricePlan).where(col(PricePlan.name) == DEFAULT_PLAN)).first()
    if plan is None:
        plan = PricePlan(name=DEFAULT_PLAN, description="the price book every tenant on no plan pays")
        session.add(plan)
        session.flush()
    return plan


def create_plan(session: Session, name: str, description: str, actor: str) -> PricePlan:
    name = name.strip()
    if not name or len(name) > 64 or not name.isprintable():
        raise ValidationError("name: 1 to 64 printable characters", param="name")
    if len(description) > 500:
        raise ValidationError("description: at most 500 characters", param="description")
    if session.exec(select(PricePlan).where(col(PricePlan.name) == name)).first() is not None:
        raise ConflictError(f"a price plan {name!r} exists already", param="name")
    plan = PricePlan(name=name, description=description)
    session.add(plan)
    session.flush()
    audit(session, actor, "price_plan.create", f"price_plan/{plan.id}", None, {"name": name})
    return plan


def assign_plan(
    session: Session, tenant: Tenant, plan: PricePlan, *, effective_from: datetime | None, actor: str
) -> TenantPlan:
    """Put ``tenant`` on ``plan`` from ``effective_from`` (now) on; earlier usage keeps the plan it had."""
    now = datetime.now(UTC)
    start = as_utc(effective_from) if effective_from is not None else now
    if (now - start).total_seconds() > 60:
        raise ValidationError("effective_from: a plan change cannot start in the past", param="effective_from")
    before = plan_of(session, tenant, start)
    row = TenantPlan(tenant_id=tenant.id or 0, plan_id=plan.id or 0, effective_from=start, created_by=actor[:128])
    session.add(row)
    session.flush()
    after = {"tenant": tenant.name, "plan": plan.name, "effective_from": start.isoformat()}
    audit(session, actor, "tenant.plan", f"tenant/{tenant.id}", {"plan": before}, after)
    return row


def plan_of(session: Session, tenant: Tenant, at: datetime) -> str:
    """The name of the plan the tenant is (was, will be) on at ``at``."""
    row = session.exec(
        select(TenantPlan)
        .where(col(TenantPlan.tenant_id) == tenant.id, col(TenantPlan.effective_from) <= as_utc(at))
        .order_by(col(TenantPlan.effective_from).desc(), col(TenantPlan.id).desc())
    ).first()
    if row is None:
        return DEFAULT_PLAN
    plan = session.get(PricePlan, row.plan_id)
    return plan.name if plan is not None else DEFAULT_PLAN


def price_json(p: Price, plan: str | None = None) -> dict[str, Any]:
    return {
        "object": "price",
        "id": p.id,
        "model": p.model,
        "version": p.version,
        "tier": p.tier,
        "currency": p.currency,
        "prompt_per_mtok": str(p.prompt_per_mtok),
        "completion_per_mtok": str(p.completion_per_mtok),
        "cached_per_mtok": str(p.cached_per_mtok),
        "per_call": str(p.per_call),
        "per_row": str(p.per_row),
        "effective_from": p.effective_from.isoformat(),
        "plan_id": p.plan_id,
        "plan": plan,
        "tenant_id": p.tenant_id,
    }


def plan_json(session: Session, plan: PricePlan) -> dict[str, Any]:
    prices = session.exec(
        select(Price).where(col(Price.plan_id) == plan.id).order_by(col(Price.model), col(Price.effective_from))
    ).all()
    tenants = session.exec(select(TenantPlan).where(col(TenantPlan.plan_id) == plan.id)).all()
    return {
        "object": "price_plan",
        "id": plan.id,
        "name": plan.name,
        "description": plan.description,
        "versions": sorted({p.effective_from.isoformat() for p in prices}),
        "prices": [price_json(p, plan.name) for p in prices],
        "num_tenants": len({t.tenant_id for t in tenants}),
    }


def list_plans(session: Session) -> list[dict[str, Any]]:
    return [plan_json(session, p) for p in session.exec(select(PricePlan).order_by(col(PricePlan.id)))]
