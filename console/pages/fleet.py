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
from controlplane.fleet.releases import desired_releases
from controlplane.policies import service as policy_service
from controlplane.storage.tables import Device, EnrollmentToken, Tenant
from shared.errors import ApplicationError, NotFoundError, ValidationError

MODEL_PREFIX = "tierline/"  # the agent reports models by id, releases are named by artifact (edge_agent.models)
# A device syncs every 30 s by default; three missed syncs and it counts as offline.
ONLINE_WITHIN = timedelta(seconds=90)


@dataclass(frozen=True, slots=True)
class Wanted:
    """One model (or one model's escalation policy) on a device: what the cloud wants it to run, what it runs."""

    name: str
    desired: str | None  # None: the cloud sends nothing for it (not targeted, or not published)
    actual: str | None  # None: the device reports nothing

    @property
    def in_sync(self) -> bool:
        return self.desired is None or self.desired == self.actual


@dataclass(frozen=True, slots=True)
class DeviceRow:
    device: Device
    tenant: str
    is_online: bool
    escalation_rate: float | None
    models: tuple[Wanted, ...] = ()
    policies: tuple[Wanted, ...] = ()

    @property
    def in_sync(self) -> bool:
        return all(w.in_sync for w in (*self.models, *self.policies))


def desired_vs_actual(session: Session, device: Device) -> tuple[tuple[Wanted, ...], tuple[Wanted, ...]]:
    """Per model: the desired release version against the loaded one; per model: the desired policy version
    against the one the device reports running (``override`` when its own file wins)."""
    desired = {r.name: r.version for r in desired_releases(session, device)}
    loaded = {m.removeprefix(MODEL_PREFIX): v for m, v in (device.versions or {}).items()}
    models = tuple(Wanted(n, desired.get(n), loaded.get(n)) for n in sorted({*desired, *loaded}))
    wanted = {r.model: str(r.version) for r in policy_service.desired_rows(session, device)}
    running = device.policies or {}
    policies = tuple(Wanted(n, wanted.get(n), running.get(n)) for n in sorted({*wanted, *running}))
    return models, policies


def label_filter(value: str) -> tuple[str, str] | None:
    """``ring=beta`` as a (key, value) filter; a ValidationError for anything else."""
    if not value:
        return None
    key, sep, wanted = value.partition("=")
    if not sep or not key.strip():
        raise ValidationError(f"label: {value!r} is not KEY=VALUE", param="label")
    return key.strip(), wanted.strip()


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
    label: str = "",
    page: int = 1,
    status_code: int = 200,
    **extra: Any,
) -> Template:
    now = datetime.now(UTC)
    query = select(Device, Tenant).join(Tenant).order_by(col(Device.last_seen_at).desc(), col(Device.id))
    if tenant:
        query = query.where(Tenant.name == tenant)
    by_label = label_filter(label)
    if by_label is not None:
        query = query.where(Device.__table__.c.labels[by_label[0]].as_string() == by_label[1])  # type: ignore[attr-defined]
    if q:
        query = query.where(
            or_(func.lower(Device.id).like(like(q), escape="\\"), func.lower(Device.name).like(like(q), escape="\\"))
        )
    with Session(db) as session:
        rows, info = paginate(session, query, page, {"q": q, "tenant": tenant, "label": label})  # type: ignore[arg-type]
        states = {d.id: desired_vs_actual(session, d) for d, _ in rows}
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
            *states[d.id],
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
        label=label,
        tenants=tenants,
        tokens=tokens,
        now=now,
        **extra,
    )


@get("/fleet", sync_to_thread=True)
def fleet(
    request: Request[Any, Any, Any], db: Engine, q: str = "", tenant: str = "", label: str = "", page: int = 1
) -> Template:
    """Devices, most recently seen first (filtered by id or name, tenant, a label ``KEY=VALUE``), each with its
    desired against its actual versions and policies; the latest enrollment tokens."""
    return _fleet_page(request, db, q=q.strip()[:64], tenant=tenant.strip()[:64], label=label.strip()[:128], page=page)


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
