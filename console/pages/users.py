"""Console users (admins only): list, create, change a role, reset a password, disable or enable, end sessions,
revoke API tokens. Every change is one call into :mod:`controlplane.accounts.users`, which writes the audit row."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from litestar import Request, get, post
from litestar.response import Redirect, Template
from sqlalchemy.engine import Engine
from sqlmodel import Session

from console.auth import require_admin, session_user
from console.pages.common import Form, errors_of, render, see_other, text, write_session
from controlplane.accounts import sessions
from controlplane.accounts import users as accounts
from shared.errors import ApplicationError

ADMIN_ONLY = [require_admin]


def _users_page(request: Request[Any, Any, Any], db: Engine, *, status_code: int = 200, **extra: Any) -> Template:
    with Session(db) as session:
        rows = accounts.list_users(session)
    extra.setdefault("form", {"role": "viewer"})
    extra.setdefault("errors", {})
    return render(
        request, "users.html.j2", status_code, rows=rows, roles=accounts.ROLES, now=datetime.now(UTC), **extra
    )


def _user_page(
    request: Request[Any, Any, Any], db: Engine, user_id: int, *, status_code: int = 200, **extra: Any
) -> Template:
    with Session(db) as session:
        target = accounts.get_user_by_id(session, user_id)
        records = sessions.list_sessions(session, user_id)
        tokens = accounts.list_tokens(session, user_id)
    extra.setdefault("errors", {})
    return render(
        request,
        "user.html.j2",
        status_code,
        target=target,
        is_disabled=accounts.is_disabled(target),
        is_self=target.id == session_user(request).id,
        sessions=[(s, sessions.is_live(s)) for s in records],
        tokens=tokens,
        roles=accounts.ROLES,
        now=datetime.now(UTC),
        **extra,
    )


@get("/users", guards=ADMIN_ONLY, sync_to_thread=True)
def users_list(request: Request[Any, Any, Any], db: Engine) -> Template:
    """Every console user with its role, state, last sign-in, live sessions and API tokens."""
    return _users_page(request, db)


@post("/users", sync_to_thread=True)
def user_create(request: Request[Any, Any, Any], db: Engine, data: Form) -> Template | Redirect:
    user = session_user(request)
    try:
        username = text(data, "username", max_length=64, required=True)
        role = text(data, "role", max_length=16, required=True)
        with write_session(db) as session:
            created = accounts.create_user(session, username, data.get("password", ""), role, actor=user.actor)
    except ApplicationError as exc:
        form = {k: v for k, v in data.items() if k != "password"}
        return _users_page(request, db, status_code=exc.status_code, form=form, errors=errors_of(exc))
    return see_other(f"/users/{created.id}")


@get("/users/{user_id:int}", guards=ADMIN_ONLY, sync_to_thread=True)
def user_detail(request: Request[Any, Any, Any], db: Engine, user_id: int) -> Template:
    """One user: role, password, state, its sessions and its API tokens."""
    return _user_page(request, db, user_id)


def _change(request: Request[Any, Any, Any], db: Engine, user_id: int, change: Any) -> Template | Redirect:
    """Run one account change; on a refusal the user page again with the reason, else back to it."""
    try:
        with write_session(db) as session:
            change(session, session_user(request))
    except ApplicationError as exc:
        return _user_page(request, db, user_id, status_code=exc.status_code, errors=errors_of(exc))
    return see_other(f"/users/{user_id}")


@post("/users/{user_id:int}/role", sync_to_thread=True)
def user_role(request: Request[Any, Any, Any], db: Engine, user_id: int, data: Form) -> Template | Redirect:
    role = data.get("role", "")
    return _change(
        request,
        db,
        user_id,
        lambda s, me: accounts.set_role(s, user_id, role, actor=me.actor, acting_user_id=me.id),
    )


@post("/users/{user_id:int}/password", sync_to_thread=True)
def user_password(request: Request[Any, Any, Any], db: Engine, user_id: int, data: Form) -> Template | Redirect:
    """A new password; every session of the user ends (it signs in again with the new one)."""
    password = data.get("password", "")
    return _change(request, db, user_id, lambda s, me: accounts.reset_password(s, user_id, password, actor=me.actor))


@post("/users/{user_id:int}/disable", sync_to_thread=True)
def user_disable(request: Request[Any, Any, Any], db: Engine, user_id: int) -> Template | Redirect:
    """Refuse the user's password, sessions and API tokens from now on."""
    return _change(
        request,
        db,
        user_id,
        lambda s, me: accounts.disable(s, user_id, actor=me.actor, acting_user_id=me.id),
    )


@post("/users/{user_id:int}/enable", sync_to_thread=True)
def user_enable(request: Request[Any, Any, Any], db: Engine, user_id: int) -> Template | Redirect:
    return _change(request, db, user_id, lambda s, me: accounts.enable(s, user_id, actor=me.actor))


@post("/users/{user_id:int}/sessions/revoke", sync_to_thread=True)
def user_sessions_revoke(request: Request[Any, Any, Any], db: Engine, user_id: int) -> Template | Redirect:
    """Sign the user out everywhere (the password stays)."""
    return _change(request, db, user_id, lambda s, me: accounts.revoke_sessions(s, user_id, actor=me.actor))


@post("/users/{user_id:int}/tokens/{token_id:int}/revoke", sync_to_thread=True)
def user_token_revoke(request: Request[Any, Any, Any], db: Engine, user_id: int, token_id: int) -> Template | Redirect:
    """Revoke one management API token of the user; requests with it get 401 from now on."""
    return _change(
        request,
        db,
        user_id,
        lambda s, me: accounts.revoke_token(s, token_id, actor=me.actor, user_id=user_id),
    )


HANDLERS = [
    users_list,
    user_create,
    user_detail,
    user_role,
    user_password,
    user_disable,
    user_enable,
    user_sessions_revoke,
    user_token_revoke,
]
