"""The fleet's management API under ``/api``, behind a console API token (``console.management_api``): edge
releases with their device targets, one device's record, and setting a release's target. Reads need a token,
changes an admin; a change writes an audit_log row (``controlplane.fleet.targets``); a bad selector term is a 400
naming ``target``.

Console operators act for the whole platform (a console user has no tenant), and edge releases are platform-wide;
a device is read under its tenant (``/api/tenants/{name}/devices/{id}``), so another tenant's device is a 404.
"""

from __future__ import annotations

from typing import Any

from litestar import get, put
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy.engine import Engine
from sqlmodel import Session, select

from console.management_api import Operator, management_router
from controlplane.fleet.targets import release_target_rows, set_release_target
from controlplane.storage.session import session_scope
from controlplane.storage.tables import Device, Tenant
from shared.errors import NotFoundError
from shared.targeting import describe, device_facts


class TargetChange(BaseModel):
    model_config = ConfigDict(extra="forbid")

    target: list[str] = Field(
        description="selector terms, all of which must hold: ring=beta, site!=lab, device.arch=x86_64, "
        "device.memory_mb>=2048, device.runtime=tflite, device.bucket<=19; [] sends the release to every device",
        max_length=16,
    )


@get("/releases", sync_to_thread=True)
def list_releases(db: Engine, operator: Operator) -> dict[str, Any]:
    """Edge releases, newest first, each with its device target and whether it has been published."""
    with Session(db) as session:
        return {"object": "list", "data": release_target_rows(session)}


@put("/releases/{name:str}/{version:str}/target", sync_to_thread=True)
def put_release_target(db: Engine, operator: Operator, name: str, version: str, data: TargetChange) -> dict[str, Any]:
    """Send edge release ``name`` ``version`` only to the devices the target selects (set it before publishing
    it, so no device outside it hears of it); an empty target sends it to every device again. Admins only."""
    operator.require_admin()
    with session_scope(db) as session:
        row = set_release_target(session, name, version, data.target, actor=operator.actor)
        terms = list(row.target) if row is not None else []
    return {
        "name": name,
        "version": version,
        "target": [f"{t['key']}{t['op']}{t['value']}" for t in terms],
        "describe": describe(terms),
    }


@get("/tenants/{tenant:str}/devices/{device_id:str}", sync_to_thread=True)
def get_device(db: Engine, operator: Operator, tenant: str, device_id: str) -> dict[str, Any]:
    """One device of a tenant: labels, reported facts, last sync, loaded versions and policies in use."""
    with Session(db) as session:
        row = session.exec(
            select(Device, Tenant).join(Tenant).where(Device.id == device_id, Tenant.name == tenant)
        ).first()
        if row is None:
            raise NotFoundError(f"no device {device_id!r} in tenant {tenant!r}", param="device_id")
        device, _ = row
        return {
            "id": device.id,
            "tenant": tenant,
            "name": device.name,
            "status": device.status,
            "labels": device.labels,
            "facts": device_facts(device.runtime or {}, device.id),
            "agent_version": device.agent_version,
            "last_seen_at": device.last_seen_at.isoformat() if device.last_seen_at else None,
            "models": device.versions,
            "policies": device.policies,
            "runtime": device.runtime,
        }


FLEET_ROUTER = management_router([list_releases, put_release_target, get_device], "fleet")
