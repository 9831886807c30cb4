"""Fleet: devices with labels, online or offline, versions and escalation rate; enrollment tokens."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import quote

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
from controlplane.fleet.targets import release_target_rows, set_release_target
from controlplane.policies import service as policy_service
from controlplane.rollouts.plans import edge_version, load_plans
from controlplane.storage.tables import Device, EnrollmentToken, Rollout, Tenant, UsageRecord
from shared.errors import ApplicationError, NotFoundError, ValidationError
from shared.targeting import device_facts

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
        releases = release_target_rows(session)
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
    extra.setdefault("target_form", {})
    extra.setdefault("target_errors", {})
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
        releases=releases,
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


# --- one device -------------------------------------------------------------------------------------------------

RECENT = timedelta(hours=24)  # the device page's usage window
RECENT_RECORDS = 20


@dataclass(frozen=True, slots=True)
class Candidate:
    """One runtime the agent weighed for a model (``runtime["serving"][model]["candidates"]``)."""

    runtime: str
    format: str
    ms_per_token: float | None
    agreement: float | None
    eligible: bool | None
    reason: str
    chosen: bool


@dataclass(frozen=True, slots=True)
class ServingChoice:
    model: str
    chosen: str
    candidates: tuple[Candidate, ...]
    fixed: bool = False  # served under its artifact's own name: the name fixes the format, nothing was weighed


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def serving_choices(runtime: dict[str, Any]) -> list[ServingChoice]:
    """The runtime choice the agent reports per model (``runtime["serving"]``), as far as it is well formed: what a
    device sends is shown, never trusted, so an entry of another shape is left out rather than breaking the page."""
    serving = runtime.get("serving") if isinstance(runtime, dict) else None
    if not isinstance(serving, dict):
        return []
    out = []
    for model, entry in sorted(serving.items()):
        if not isinstance(model, str) or not isinstance(entry, dict):
            continue
        picked = entry.get("chosen")
        chosen = picked if isinstance(picked, str) else ""
        rows = []
        for c in entry.get("candidates") or []:
            if not isinstance(c, dict):
                continue
            name = str(c.get("runtime") or "")[:64]
            fmt = str(c.get("format") or "")[:64]
            eligible = c.get("eligible")
            rows.append(
                Candidate(
                    runtime=name,
                    format=fmt,
                    ms_per_token=_number(c.get("ms_per_token")),
                    agreement=_number(c.get("agreement")),
                    eligible=eligible if isinstance(eligible, bool) else None,
                    reason=str(c.get("reason") or "")[:300],
                    chosen=bool(chosen) and chosen in (name, f"{name}/{fmt}", f"{name}:{fmt}", fmt),
                )
            )
        out.append(ServingChoice(model[:128], chosen[:128], tuple(rows), entry.get("fixed") is True))
    return out


@dataclass(frozen=True, slots=True)
class RecentUsage:
    """A device's usage records over :data:`RECENT`: per tier, per escalation reason, the latest records."""

    by_tier: dict[str, int]
    by_reason: list[tuple[str, int]]
    records: list[UsageRecord]

    @property
    def total(self) -> int:
        """Requests the device answered or escalated; its shadow replays are the quality monitor's, not answers."""
        return sum(n for tier, n in self.by_tier.items() if tier in ("edge", "cloud"))

    @property
    def edge_share(self) -> float | None:
        return self.by_tier.get("edge", 0) / self.total if self.total else None


def recent_usage(session: Session, device: Device, since: datetime) -> RecentUsage:
    where = (col(UsageRecord.tenant_id) == device.tenant_id, col(UsageRecord.device_id) == device.id)
    recent = (*where, col(UsageRecord.occurred_at) >= since)
    tiers = session.exec(select(UsageRecord.tier, func.count()).where(*recent).group_by(col(UsageRecord.tier))).all()
    reasons = session.exec(
        select(UsageRecord.escalation_reason, func.count())
        .where(*recent, col(UsageRecord.escalation_reason).is_not(None))
        .group_by(col(UsageRecord.escalation_reason))
        .order_by(func.count().desc())
    ).all()
    records = session.exec(
        select(UsageRecord).where(*where).order_by(col(UsageRecord.occurred_at).desc()).limit(RECENT_RECORDS)
    ).all()
    return RecentUsage({t: int(n) for t, n in tiers}, [(r or "", int(n)) for r, n in reasons], list(records))


def device_rollouts(session: Session, device: Device) -> list[tuple[Rollout, str]]:
    """The active rollouts whose fleet this device is in, with the version it is assigned."""
    active = session.exec(
        select(Rollout).where(
            col(Rollout.status).in_(("pending", "running", "paused")),
            col(Rollout.scope).in_(("edge", "both")),
            or_(col(Rollout.tenant_id).is_(None), col(Rollout.tenant_id) == device.tenant_id),
        )
    ).all()
    out = []
    for r in active:
        if not all((device.labels or {}).get(k) == v for k, v in r.device_selector.items()):
            continue
        plan = next((p for p in load_plans(session, "edge", kind=r.kind) if p.id == r.id), None)
        if plan is not None:
            out.append((r, edge_version(plan, device.id, device.tenant_id, device.labels or {})))
    return out


def _device_of(session: Session, device_id: str, tenant: str | None = None) -> tuple[Device, Tenant]:
    query = select(Device, Tenant).join(Tenant).where(Device.id == device_id)
    if tenant is not None:
        query = query.where(Tenant.name == tenant)
    row = session.exec(query).first()
    if row is None:
        where = f" in tenant {tenant!r}" if tenant is not None else ""
        raise NotFoundError(f"no device {device_id!r}{where}", param="device")
    return row


@get("/fleet/devices/{device_id:str}", sync_to_thread=True)
def device_page_redirect(db: Engine, device_id: str) -> Redirect:
    """A device's page lives under its tenant."""
    with Session(db) as session:
        _, tenant = _device_of(session, device_id[:64])
    return see_other(f"/tenants/{quote(tenant.name)}/devices/{quote(device_id)}")


@get("/tenants/{name:str}/devices/{device_id:str}", sync_to_thread=True)
def device_page(request: Request[Any, Any, Any], db: Engine, name: str, device_id: str) -> Template:
    """One device of a tenant (another tenant's device is a 404): labels, reported facts, last sync, desired vs
    actual models and policies, the rollouts it is in, per-version counters, the agent's runtime choice when it
    reports one, and its usage over the last 24 h (edge and cloud counts, escalation reasons, latest records)."""
    now = datetime.now(UTC)
    with Session(db) as session:
        device, tenant = _device_of(session, device_id[:64], name[:64])
        models, policies = desired_vs_actual(session, device)
        usage = recent_usage(session, device, now - RECENT)
        rollouts = device_rollouts(session, device)
    facts = device_facts(device.runtime or {}, device.id)
    counters = sorted(
        (key, c) for key, c in (device.metrics or {}).items() if isinstance(key, str) and isinstance(c, dict)
    )
    return render(
        request,
        "fleet_device.html.j2",
        nav_here="/fleet",  # its address is under the tenant's, but a device belongs to the Fleet section
        device=device,
        tenant=tenant,
        is_online=device.status == "active"
        and device.last_seen_at is not None
        and device.last_seen_at > now - ONLINE_WITHIN,
        facts=facts,
        models=models,
        policies=policies,
        usage=usage,
        rollouts=rollouts,
        counters=counters,
        escalation_rate=escalation_rate(device.metrics or {}),
        serving=serving_choices(device.runtime or {}),
        now=now,
    )


@post("/fleet/release-targets", sync_to_thread=True)
def release_target_set(request: Request[Any, Any, Any], db: Engine, data: Form) -> Template | Redirect:
    """Target an edge release (artifact name and version) at the devices a selector picks; empty: every device.
    Set it before publishing, so no device outside it hears of the release. Audited."""
    user = session_user(request)
    try:
        name = text(data, "name", max_length=128, required=True)
        version = text(data, "version", max_length=128, required=True)
        terms = [t.strip() for t in text(data, "target", max_length=2000).split(",") if t.strip()]
        with write_session(db) as session:
            set_release_target(session, name, version, terms, actor=user.actor)
    except ApplicationError as exc:
        return _fleet_page(request, db, status_code=400, target_form=data, target_errors=errors_of(exc))
    return see_other("/fleet#release-targets")


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
    release_target_set,
    device_page_redirect,
    device_page,
    enrollment_token_create,
    enrollment_token_revoke_confirm,
    enrollment_token_revoke,
    device_revoke_confirm,
    device_revoke,
]
