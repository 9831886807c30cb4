"""Escalation policies under ``/api/policies``: list, read (with the curve), calibrate in the control plane on the
model's kept validation set, and move the operating point. Reads need a console API token; changes an admin.
``{model}`` is the edge model id's last part (``digits-small``) or the id with ``/`` as ``__``. The rules, the
signing and the audit rows live in :mod:`controlplane.policies.service`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from litestar import get, post
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy.engine import Engine
from sqlmodel import Session

from console.management_api import Operator, management_router
from controlplane.policies import service
from controlplane.registry.artifacts import platform_signing_key
from controlplane.storage.session import session_scope


def _model(name: str) -> str:
    return name.replace("__", "/")


class PolicyChange(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_quality_loss: float = Field(ge=0.0, le=1.0, description="largest allowed drop below cloud-only quality")
    target: list[str] | None = Field(
        None, description="device selector terms (ring=beta, device.memory_mb>=2048); default: the latest version's"
    )


@get("/policies", sync_to_thread=True)
def list_policies(db: Engine, operator: Operator) -> dict[str, Any]:
    """Every model's policy versions, newest first."""
    with Session(db) as session:
        rows = [service.policy_json(r) for m in service.models(session) for r in service.versions_of(session, m)]
    return {"object": "list", "data": rows}


@get("/policies/{name:str}", sync_to_thread=True)
def get_policy(db: Engine, operator: Operator, name: str, version: int | None = None) -> dict[str, Any]:
    """One version (default: the newest) with its curve and the whole policy."""
    with Session(db) as session:
        return service.policy_json(service.get_version(session, _model(name), version), with_curve=True)


def _new_version(
    db: Engine, operator: Operator, name: str, data: PolicyChange, make: Callable[..., Any]
) -> dict[str, Any]:
    """A new version of ``name``'s policy made by ``make`` (the service's move or calibrate); admins only."""
    operator.require_admin()
    with session_scope(db) as session:
        row = make(
            session,
            _model(name),
            max_quality_loss=data.max_quality_loss,
            target=data.target,
            actor=operator.actor,
            key=platform_signing_key(),
        )
        return service.policy_json(row, with_curve=True)


@post("/policies/{name:str}/operating-point", status_code=201, sync_to_thread=True)
def move_operating_point(db: Engine, operator: Operator, name: str, data: PolicyChange) -> dict[str, Any]:
    """A new version at another point of the latest version's curve (no recalibration)."""
    return _new_version(db, operator, name, data, service.move_operating_point)


@post("/policies/{name:str}/calibrate", status_code=201, sync_to_thread=True)
def calibrate(db: Engine, operator: Operator, name: str, data: PolicyChange) -> dict[str, Any]:
    """Calibrate again on the model's kept validation set (given once with ``tierline policies calibrate --data``)."""
    return _new_version(db, operator, name, data, service.calibrate)


POLICIES_ROUTER = management_router([list_policies, get_policy, move_operating_point, calibrate], "policies")
