"""Money controls under ``/api``: projects, scoped budgets, price plans, prepaid credit.

Every route takes a console API token (``Authorization: Bearer tlc-...``); reads are open to viewers, changes need
an admin and are audited (by the service they call). Money travels as strings (``"12.50"``), never floats.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from litestar import delete, get, post, put
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy.engine import Engine
from sqlmodel import Session

from console.management_api import Operator, management_router
from controlplane.billing import budget_admin, credit, plans
from controlplane.billing.invoicing import resolve_tenant
from controlplane.storage.session import session_scope


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ProjectCreate(_Body):
    name: str = Field(min_length=1, max_length=64)


class KeyProject(_Body):
    project: str | None = Field(description="project name or id; null takes the key out of its project")


class BudgetSet(_Body):
    scope: Literal["tenant", "key", "project", "user"]
    ref: str | None = Field(None, max_length=256, description="key id, project, end user id or '*'; tenant: none")
    period: Literal["day", "month", "total"]
    amount: str = Field(description='the limit, a string: "5.00"')
    is_hard: bool = Field(True, description="false: count and report only, never refuse")


class PlanCreate(_Body):
    name: str = Field(min_length=1, max_length=64)
    description: str = Field("", max_length=500)


class PlanAssign(_Body):
    plan: str = Field(min_length=1, max_length=64)
    effective_from: datetime | None = Field(None, description="default now; never in the past")


class TopUp(_Body):
    amount: str = Field(description='positive, a string: "100.00"')
    note: str = Field("", max_length=500)


class LowBalance(_Body):
    below: str | None = Field(description='alert when the balance falls below this ("10.00"); null: never')


# --- projects ---------------------------------------------------------------------------------------------------


@get("/tenants/{tenant:str}/projects", sync_to_thread=True)
def list_projects(db: Engine, operator: Operator, tenant: str) -> dict[str, Any]:
    with Session(db) as session:
        return {"object": "list", "data": budget_admin.list_projects(session, resolve_tenant(session, tenant))}


@post("/tenants/{tenant:str}/projects", status_code=201, sync_to_thread=True)
def create_project(db: Engine, operator: Operator, tenant: str, data: ProjectCreate) -> dict[str, Any]:
    operator.require_admin()
    with session_scope(db) as session:
        project = budget_admin.create_project(session, resolve_tenant(session, tenant), data.name, operator.actor)
        return budget_admin.project_view(project, [])


@put("/tenants/{tenant:str}/keys/{key_id:int}/project", sync_to_thread=True)
def set_key_project(db: Engine, operator: Operator, tenant: str, key_id: int, data: KeyProject) -> dict[str, Any]:
    """Put one of the tenant's API keys in a project (or in none)."""
    operator.require_admin()
    with session_scope(db) as session:
        row = resolve_tenant(session, tenant)
        project = budget_admin.get_project(session, row, data.project) if data.project is not None else None
        key = budget_admin.assign_key(session, row, key_id, project, operator.actor)
        return {"object": "api_key", "id": key.id, "project_id": key.project_id}


# --- budgets ----------------------------------------------------------------------------------------------------


@get("/tenants/{tenant:str}/budgets", sync_to_thread=True)
def list_budgets(db: Engine, operator: Operator, tenant: str) -> dict[str, Any]:
    """The tenant's scoped budgets, each with its current window's spend."""
    with Session(db) as session:
        return {"object": "list", "data": budget_admin.list_budgets(session, resolve_tenant(session, tenant))}


@post("/tenants/{tenant:str}/budgets", status_code=201, sync_to_thread=True)
def set_budget(db: Engine, operator: Operator, tenant: str, data: BudgetSet) -> dict[str, Any]:
    """Create the budget of (scope, ref, period), or change its amount and kind."""
    operator.require_admin()
    amount = budget_admin.parse_amount(data.amount)
    with session_scope(db) as session:
        row = resolve_tenant(session, tenant)
        budget = budget_admin.set_budget(
            session,
            row,
            scope=data.scope,
            ref=data.ref,
            period=data.period,
            amount=amount,
            is_hard=data.is_hard,
            actor=operator.actor,
        )
        return budget_admin.budget_view(session, budget)


@delete("/tenants/{tenant:str}/budgets/{budget_id:int}", status_code=204, sync_to_thread=True)
def delete_budget(db: Engine, operator: Operator, tenant: str, budget_id: int) -> None:
    operator.require_admin()
    with session_scope(db) as session:
        budget_admin.delete_budget(session, resolve_tenant(session, tenant), budget_id, operator.actor)


# --- plans ------------------------------------------------------------------------------------------------------


@get("/plans", sync_to_thread=True)
def list_plans(db: Engine, operator: Operator) -> dict[str, Any]:
    """Every price plan with its prices and versions (the distinct effective dates of its prices)."""
    with Session(db) as session:
        return {"object": "list", "data": plans.list_plans(session)}


@post("/plans", status_code=201, sync_to_thread=True)
def create_plan(db: Engine, operator: Operator, data: PlanCreate) -> dict[str, Any]:
    operator.require_admin()
    with session_scope(db) as session:
        return plans.plan_json(session, plans.create_plan(session, data.name, data.description, operator.actor))


@post("/tenants/{tenant:str}/plan", status_code=201, sync_to_thread=True)
def assign_plan(db: Engine, operator: Operator, tenant: str, data: PlanAssign) -> dict[str, Any]:
    """Put the tenant on a plan from ``effective_from`` (now) on; earlier usage keeps the plan it had."""
    operator.require_admin()
    with session_scope(db) as session:
        row = resolve_tenant(session, tenant)
        plan = plans.get_plan(session, data.plan)
        assigned = plans.assign_plan(session, row, plan, effective_from=data.effective_from, actor=operator.actor)
        return {
            "object": "tenant_plan",
            "tenant": row.name,
            "plan": plan.name,
            "effective_from": assigned.effective_from.isoformat(),
        }


# --- prepaid credit ---------------------------------------------------------------------------------------------


@get("/tenants/{tenant:str}/credit", sync_to_thread=True)
def get_credit(db: Engine, operator: Operator, tenant: str) -> dict[str, Any]:
    """The tenant's prepaid balance, holds, low-balance line (``is_low``) and latest entries."""
    with Session(db) as session:
        return credit.credit_view(session, resolve_tenant(session, tenant))


@post("/tenants/{tenant:str}/credit/top-ups", status_code=201, sync_to_thread=True)
def top_up(db: Engine, operator: Operator, tenant: str, data: TopUp) -> dict[str, Any]:
    operator.require_admin()
    amount = budget_admin.parse_amount(data.amount)
    with session_scope(db) as session:
        row = resolve_tenant(session, tenant)
        credit.top_up(session, row, amount, note=data.note, actor=operator.actor)
        return credit.credit_view(session, row)


@put("/tenants/{tenant:str}/credit/low-balance", sync_to_thread=True)
def set_low_balance(db: Engine, operator: Operator, tenant: str, data: LowBalance) -> dict[str, Any]:
    operator.require_admin()
    threshold = budget_admin.parse_amount(data.below, "below") if data.below is not None else None
    with session_scope(db) as session:
        row = resolve_tenant(session, tenant)
        credit.set_low_balance(session, row, threshold, actor=operator.actor)
        return credit.credit_view(session, row, limit=0)


MONEY_ROUTER = management_router(
    [
        list_projects,
        create_project,
        set_key_project,
        list_budgets,
        set_budget,
        delete_budget,
        list_plans,
        create_plan,
        assign_plan,
        get_credit,
        top_up,
        set_low_balance,
    ],
    "money",
)
