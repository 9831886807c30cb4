"""Sign-in and sign-out. The only console pages without the session guard.

A sign-in attempt is counted (atomically, shared by every replica) before its password is checked, so parallel
guesses cannot outrun the limit; a successful one opens a session record on the server, and signing out revokes
it, so a copy of the cookie stops working too.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import anyio.to_thread
from litestar import Request, Response, get, post
from litestar.datastructures import Cookie
from litestar.response import Redirect, Template
from sqlalchemy import update
from sqlalchemy.engine import Engine
from sqlmodel import col

from console.auth import CSRF_FIELD, SESSION_COOKIE, check_password
from console.pages.common import Form
from console.session_cookie import ConsoleAuth, SessionData, new_session, password_fingerprint
from controlplane.accounts import sessions
from controlplane.accounts.login_throttle import throttle_key
from controlplane.storage.session import session_scope
from controlplane.storage.tables import ConsoleUser
from shared.errors import PermissionDeniedError


def _cookie(auth: ConsoleAuth, request: Request[Any, Any, Any], data: SessionData | None) -> Cookie:
    secure = auth.cookie_is_secure(request)
    if data is None:
        return Cookie(key=SESSION_COOKIE, value="", max_age=0, httponly=True, samesite="lax", secure=secure)
    return Cookie(
        key=SESSION_COOKIE,
        value=auth.codec.encode(data),
        max_age=auth.settings.session_max_age_s,
        httponly=True,
        samesite="lax",
        secure=secure,
    )


def _safe_next(target: str | None) -> str:
    """Only paths on this site: never ``//host`` or an absolute URL (no open redirect)."""
    if not target or not target.startswith("/") or target.startswith("//") or "\\" in target:
        return "/"
    return target


def _login_page(
    request: Request[Any, Any, Any],
    auth: ConsoleAuth,
    data: SessionData,
    *,
    next_path: str,
    error: str = "",
    username: str = "",
    status_code: int = 200,
    headers: dict[str, str] | None = None,
) -> Template:
    return Template(
        template_name="login.html.j2",
        context={
            "user": None,
            "csrf": auth.codec.csrf_token(data.sid),
            "next": next_path,
            "error": error,
            "username": username,
        },
        status_code=status_code,
        cookies=[_cookie(auth, request, data)],
        headers=headers,
    )


@get("/login", sync_to_thread=False)
def login_form(request: Request[Any, Any, Any], auth: ConsoleAuth, next: str | None = None) -> Template:
    """The sign-in form; sets a pre-session cookie its CSRF token is bound to."""
    data = auth.codec.decode(request.cookies.get(SESSION_COOKIE))
    if data is None or data.user_id is not None:
        data = new_session()
    return _login_page(request, auth, data, next_path=_safe_next(next))


@post("/login")
async def login(request: Request[Any, Any, Any], db: Engine, auth: ConsoleAuth, data: Form) -> Response[Any]:
    """Count the attempt, then check the password; a fresh session id (and record) on success."""
    pre = auth.codec.decode(request.cookies.get(SESSION_COOKIE))
    next_path = _safe_next(data.get("next"))
    if pre is None or not auth.codec.is_valid_csrf(pre.sid, data.get(CSRF_FIELD)):
        return _login_page(
            request,
            auth,
            new_session(),
            next_path=next_path,
            error="This form has expired. Sign in again.",
            status_code=403,
        )
    username = data.get("username", "").strip()[:64]
    client = request.client.host if request.client else ""
    key = throttle_key(username, client)
    wait = await anyio.to_thread.run_sync(auth.throttle.hit, db, key)
    if wait is not None:
        return _login_page(
            request,
            auth,
            pre,
            next_path=next_path,
            username=username,
            error=f"Too many failed sign-ins. Try again in {max(1, round(wait))} seconds.",
            status_code=429,
            headers={"Retry-After": str(max(1, round(wait)))},
        )
    user = await anyio.to_thread.run_sync(check_password, db, username, data.get("password", ""))
    if user is None or user.id is None:
        return _login_page(
            request,
            auth,
            pre,
            next_path=next_path,
            username=username,
            error="Wrong username or password.",
            status_code=401,
        )
    await anyio.to_thread.run_sync(auth.throttle.clear, db, key)
    signed_in = new_session(user.id, password_fingerprint(user.password_hash))
    agent = request.headers.get("user-agent", "")
    await anyio.to_thread.run_sync(_open_session, db, auth, signed_in, client, agent)
    return Redirect(next_path, status_code=303, cookies=[_cookie(auth, request, signed_in)])


def _open_session(db: Engine, auth: ConsoleAuth, data: SessionData, client: str, user_agent: str) -> None:
    assert data.user_id is not None
    with session_scope(db) as session:
        sessions.open_session(
            session,
            data.user_id,
            data.sid,
            max_age_s=auth.settings.session_max_age_s,
            client=client,
            user_agent=user_agent,
        )
        session.execute(
            update(ConsoleUser).where(col(ConsoleUser.id) == data.user_id).values(last_login_at=datetime.now(UTC))
        )


@post("/logout", sync_to_thread=True)
def logout(request: Request[Any, Any, Any], db: Engine, auth: ConsoleAuth, data: Form) -> Redirect:
    """End the session: its record is revoked (so every copy of the cookie is refused) and the cookie cleared.

    Needs the page's CSRF token, like every change.
    """
    current = auth.codec.decode(request.cookies.get(SESSION_COOKIE))
    if current is not None and not auth.codec.is_valid_csrf(current.sid, data.get(CSRF_FIELD)):
        raise PermissionDeniedError("missing or invalid CSRF token; reload the page and try again", code="csrf")
    if current is not None and current.user_id is not None:
        with session_scope(db) as session:
            sessions.revoke_session(session, current.sid)
    return Redirect("/login", status_code=303, cookies=[_cookie(auth, request, None)])


LOGIN_HANDLERS = [login_form, login, logout]
