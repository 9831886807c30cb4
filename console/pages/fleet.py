"""Fleet: devices with labels, online or offline, versions and escalation rate; enrollment tokens."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from litestar import Request, get, post
from litestar.response import Redirect, Template
from sqlalchemy import func, or_
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from console.auth import session_user
from console.pages import changes
from console.pages.common import (
    Form,
    errors_of,
    labels,
    like,
    optional_float,
    paginate,
    render,
    see_other,
    text,
    write_session,
)
from controlplane.storage.tables import Device, EnrollmentToken, Tenant
from shared.errors import ApplicationError, NotFoundError

# A device syncs every 30 s by default; three missed syncs and it counts as offline.
ONLINE_WITHIN = timedelta(seconds=90)


@dataclass(frozen=True, slots=True)
class DeviceRow:
    device: Device
    tenant: str
    is_online: bool
    escalation_rate: float | None


def escalation_rate(metrics: dict[str, Any]) -> float | None:
    """Escalations per request over every version the device reported (cumulative counters)."""
    requests = escalations = 0
    for counters in metrics.values():
        if isinstance(counters, dict):
            requests += int(counters.get("requests") or 0)
            escalations += int(counters.get("escalations") or 0)
    return escalations / requests if requests else None


def _fleet_page(
    request: Request[Any, Any, Any],
    db: Engine,
    *,
    q: str = "",
    tenant: str = "",
    page: int = 1,
    status_code: int = 200,
    **extra: Any,
) -> Template:
    now = datetime.now(UTC)
    query = select(Device, Tenant).join(Tenant).order_by(col(Device.last_seen_at).desc(), col(Device.id))
    if tenant:
        query = query.where(Tenant.name == tenant)
    if q:
        query = query.where(
            or_(func.lower(Device.id).like(like(q), escape="\\"), func.lower(Device.name).like(like(q), escape="\\"))
        )
    with Session(db) as session:
        rows, info = paginate(session, query, page, {"q": q, "tenant": tenant})  # type: ignore[arg-type]
        tokens = list(
            session.exec(
                select(EnrollmentToken, Tenant).join(Tenant).order_by(col(EnrollmentToken.id).desc()).limit(50)
            )
        )
        tenants = changes.tenant_names(session)
    devices = [
        DeviceRow(
            d,
            t.name,
            d.status == "active" and d.last_seen_at is not None and d.last_seen_at > now - ONLINE_WITHIN,
            escalation_rate(d.metrics),
        )
        for d, t in rows
    ]
    extra.setdefault("form", {"tenant": tenant, "ttl_hours": "24"})
    extra.setdefault("errors", {})
    return render(
        request,
        "fleet.html.j2",
        status_code,
        devices=devices,
        page=info,
        q=q,
        tenant=tenant,
        tenants=tenants,
        tokens=tokens,
        now=now,
        **extra,
    )


@get("/fleet", sync_to_thread=True)
def fleet(request: Request[Any, Any, Any], db: Engine, q: str = "", tenant: str = "", page: int = 1) -> Template:
    """Devices, most recently seen first, and the latest enrollment tokens."""
    return _fleet_page(request, db, q=q.strip()[:64], tenant=tenant.strip()[:64], page=page)


@post("/fleet/enrollment-tokens", sync_to_thread=True)
def enrollment_token_create(request: Request[Any, Any, Any], db: Engine, data: Form) -> Template:
    """A one-time token for ``tierline edge enroll``, shown once."""
    user = session_user(request)
    try:
        tenant = text(data, "tenant", max_length=64, required=True)
        ttl = optional_float(data, "ttl_hours", minimum=0.1, maximum=24 * 30) or 24.0
        with write_session(db) as session:
            issued = changes.create_enrollment_token(session, tenant, labels(data, "labels"), ttl, actor=user.actor)
    except ApplicationError as exc:
        if isinstance(exc, NotFoundError):
            exc.param = "tenant"
        return _fleet_page(request, db, status_code=400, form=data, errors=errors_of(exc))
    return _fleet_page(request, db, status_code=201, new_token=issued.secret)


@get("/fleet/enrollment-tokens/{token_id:int}/revoke", sync_to_thread=False)
def enrollment_token_revoke_confirm(request: Request[Any, Any, Any], token_id: int) -> Template:
    return render(
        request,
        "confirm.html.j2",
        title=f"Revoke enrollment token {token_id}",
        message="No device will be able to enroll with this token any more.",
        action=f"/fleet/enrollment-tokens/{token_id}/revoke",
        button="Revoke token",
        cancel="/fleet",
    )


@post("/fleet/enrollment-tokens/{token_id:int}/revoke", sync_to_thread=True)
def enrollment_token_revoke(request: Request[Any, Any, Any], db: Engine, token_id: int, data: Form) -> Redirect:
    with write_session(db) as session:
        changes.revoke_enrollment_token(session, token_id, actor=session_user(request).actor)
    return see_other("/fleet")


@get("/fleet/devices/{device_id:str}/revoke", sync_to_thread=False)
def device_revoke_confirm(request: Request[Any, Any, Any], device_id: str) -> Template:
    return render(
        request,
        "confirm.html.j2",
        title=f"Revoke device {device_id}",
        message="Its credential stops working at once; the device must enroll again with a new token.",
        action=f"/fleet/devices/{device_id}/revoke",
        button="Revoke device",
        cancel="/fleet",
    )


@post("/fleet/devices/{device_id:str}/revoke", sync_to_thread=True)
def device_revoke(request: Request[Any, Any, Any], db: Engine, device_id: str, data: Form) -> Redirect:
    with write_session(db) as session:
        changes.revoke_device(session, device_id, actor=session_user(request).actor)
    return see_other("/fleet")


HANDLERS = [
    fleet,
    enrollment_token_create,
    enrollment_token_revoke_confirm,
    enrollment_token_revoke,
    device_revoke_confirm,
    device_revoke,
]
