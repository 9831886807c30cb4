"""API keys: every tenant's keys with last use; create (the key is shown once) and revoke (after confirming)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from litestar import Request, get, post
from litestar.response import Redirect, Template
from sqlalchemy import func, or_
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from console.auth import session_user
from console.pages import changes
from console.pages.common import Form, errors_of, like, optional_int, paginate, render, see_other, text, write_session
from controlplane.storage.tables import ApiKey, Tenant
from shared.errors import ApplicationError, NotFoundError


def _keys_page(
    request: Request[Any, Any, Any],
    db: Engine,
    *,
    q: str = "",
    tenant: str = "",
    page: int = 1,
    status_code: int = 200,
    **extra: Any,
) -> Template:
    query = select(ApiKey, Tenant).join(Tenant).order_by(col(ApiKey.id).desc())
    if tenant:
        query = query.where(Tenant.name == tenant)
    if q:
        query = query.where(
            or_(
                func.lower(ApiKey.name).like(like(q), escape="\\"),
                func.lower(ApiKey.prefix).like(like(q), escape="\\"),
                func.lower(Tenant.name).like(like(q), escape="\\"),
            )
        )
    with Session(db) as session:
        rows, info = paginate(session, query, page, {"q": q, "tenant": tenant})  # type: ignore[arg-type]
        tenants = changes.tenant_names(session)
    extra.setdefault("form", {"tenant": tenant})
    extra.setdefault("errors", {})
    return render(
        request,
        "keys.html.j2",
        status_code,
        rows=[(key, owner.name) for key, owner in rows],
        page=info,
        q=q,
        tenant=tenant,
        tenants=tenants,
        now=datetime.now(UTC),
        **extra,
    )


@get("/keys", sync_to_thread=True)
def keys_list(request: Request[Any, Any, Any], db: Engine, q: str = "", tenant: str = "", page: int = 1) -> Template:
    """API keys, newest first, with the tenant, state and last use; search by name, prefix or tenant."""
    return _keys_page(request, db, q=q.strip()[:64], tenant=tenant.strip()[:64], page=page)


@post("/keys", sync_to_thread=True)
def key_create(request: Request[Any, Any, Any], db: Engine, data: Form) -> Template:
    """Create a key and show it this once; only its hash is stored."""
    user = session_user(request)
    try:
        tenant = text(data, "tenant", max_length=64, required=True)
        name = text(data, "name", max_length=200)
        days = optional_int(data, "expires_in_days", minimum=1, maximum=3650)
        with write_session(db) as session:
            issued = changes.create_api_key(session, tenant, name, days, actor=user.actor)
    except ApplicationError as exc:
        if isinstance(exc, NotFoundError):
            exc.param = "tenant"
        return _keys_page(request, db, status_code=400, form=data, errors=errors_of(exc))
    return _keys_page(request, db, tenant=tenant, status_code=201, new_key=issued.secret, new_key_record=issued.record)


@get("/keys/{key_id:int}/revoke", sync_to_thread=True)
def key_revoke_confirm(request: Request[Any, Any, Any], db: Engine, key_id: int) -> Template:
    """Asks before revoking: a revoked key stops working at once and cannot be restored."""
    with Session(db) as session:
        row = session.exec(select(ApiKey, Tenant).join(Tenant).where(ApiKey.id == key_id)).first()
    if row is None:
        raise NotFoundError(f"no API key with id {key_id}", param="id")
    key, tenant = row
    return render(
        request,
        "confirm.html.j2",
        title=f"Revoke API key {key.prefix}…",
        message=f"Requests with key {key.prefix}… ({key.name or 'unnamed'}) of tenant {tenant.name} will be "
        "refused from now on. This cannot be undone.",
        action=f"/keys/{key_id}/revoke",
        button="Revoke key",
        cancel=f"/tenants/{tenant.name}",
    )


@post("/keys/{key_id:int}/revoke", sync_to_thread=True)
def key_revoke(request: Request[Any, Any, Any], db: Engine, key_id: int, data: Form) -> Redirect:
    user = session_user(request)
    with write_session(db) as session:
        key = changes.revoke_api_key(session, key_id, actor=user.actor)
        tenant = session.get(Tenant, key.tenant_id)
    return see_other(f"/tenants/{tenant.name}" if tenant else "/keys")


HANDLERS = [keys_list, key_create, key_revoke_confirm, key_revoke]
