"""Console sign-in: server-side sessions in signed cookies, CSRF tokens, roles, login throttling, security headers.

The cookie is signed (HMAC-SHA256 with a key derived from ``TIERLINE_SECRET_KEY``) and carries a random session
id, the user id, when it was issued and a fingerprint of the user's password hash. The session itself is a record
on the server (:mod:`controlplane.accounts.sessions`, keyed by a hash of the id), so signing out, a password reset,
disabling the user or an admin ends it for every copy of the cookie at once. The role is read from the database on
every request. The CSRF token is an HMAC of the session id: every form carries it as ``_csrf`` and HTMX sends it as
``X-CSRF-Token``; a change without a valid one is refused (403) before any handler runs, and so is a change by a
viewer.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from typing import Any

import anyio.to_thread
from litestar import Request
from litestar.connection import ASGIConnection
from litestar.handlers.base import BaseRouteHandler
from litestar.types import ASGIApp, Message, Receive, Scope, Send
from sqlalchemy.engine import Engine
from sqlmodel import Session, select

from console.session_cookie import SessionData, password_fingerprint
from console.state import ConsoleState
from controlplane.accounts import sessions
from controlplane.accounts.users import verify_password
from controlplane.storage.tables import ConsoleUser
from shared.errors import PermissionDeniedError
from shared.service_app import typed_state

SESSION_COOKIE = "tierline_console"
CSRF_FIELD = "_csrf"
CSRF_HEADER = "x-csrf-token"
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
CONTENT_SECURITY_POLICY = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
    "object-src 'none'; base-uri 'self'; form-action 'self'; frame-ancestors 'none'"
)
_SECURITY_HEADERS = (
    (b"content-security-policy", CONTENT_SECURITY_POLICY.encode()),
    (b"x-content-type-options", b"nosniff"),
    (b"x-frame-options", b"DENY"),
    (b"referrer-policy", b"same-origin"),
)


class LoginRequiredError(Exception):
    """No valid session: the browser is sent to the sign-in page."""


@dataclass(frozen=True, slots=True)
class SessionUser:
    """The signed-in console user of a request (``request.user``)."""

    id: int
    username: str
    role: str
    csrf_token: str

    @property
    def actor(self) -> str:
        return f"console:{self.username}"

    @property
    def is_admin(self) -> bool:
        return self.role == "admin"


def check_password(engine: Engine, username: str, password: str) -> ConsoleUser | None:
    """The enabled user when the password matches its argon2id hash; None otherwise (in constant-ish time)."""
    with Session(engine) as session:
        user = session.exec(select(ConsoleUser).where(ConsoleUser.username == username)).first()
    return user if verify_password(user, password) else None


def _load_user(engine: Engine, data: SessionData) -> ConsoleUser | None:
    if data.user_id is None:
        return None
    with Session(engine) as session:
        user = sessions.active_user(session, data.sid)
    if user is None or user.id != data.user_id:
        return None
    if not hmac.compare_digest(password_fingerprint(user.password_hash), data.fingerprint):
        return None
    return user


async def _submitted_csrf(connection: ASGIConnection[Any, Any, Any, Any]) -> str | None:
    token = connection.headers.get(CSRF_HEADER)
    if token:
        return token
    if connection.headers.get("content-type", "").lower().startswith("multipart/"):
        # An upload is streamed to the artifact store by its handler, never buffered here: its token travels
        # in the header (the upload forms send it through htmx).
        return None
    form = await Request(connection.scope, connection.receive).form()  # parsed once, cached for the handler
    value = form.get(CSRF_FIELD)
    return value if isinstance(value, str) else None


async def require_console_user(connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler) -> None:
    """Guard of every console page: a valid session; on a change, a valid CSRF token and the admin role."""
    console = typed_state(connection.app.state, ConsoleState)
    auth = console.auth
    data = auth.codec.decode(connection.cookies.get(SESSION_COOKIE))
    if data is None:
        raise LoginRequiredError
    user = await anyio.to_thread.run_sync(_load_user, console.db, data)
    if user is None or user.id is None:
        raise LoginRequiredError
    connection.scope["user"] = SessionUser(user.id, user.username, user.role, auth.codec.csrf_token(data.sid))
    if connection.scope.get("method", "GET") in SAFE_METHODS:
        return
    if not auth.codec.is_valid_csrf(data.sid, await _submitted_csrf(connection)):
        raise PermissionDeniedError("missing or invalid CSRF token; reload the page and try again", code="csrf")
    if user.role != "admin":
        raise PermissionDeniedError(f"{user.username} is a {user.role}; only an admin can change anything")


async def require_admin(connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler) -> None:
    """Guard of the pages only admins may even read (console users); runs after :func:`require_console_user`."""
    user = connection.scope.get("user")
    if not isinstance(user, SessionUser) or not user.is_admin:
        name = getattr(user, "username", "this user")
        raise PermissionDeniedError(f"{name} is a {getattr(user, 'role', 'viewer')}; only an admin can see this page")


def session_user(request: Request[Any, Any, Any]) -> SessionUser:
    user = request.scope.get("user")
    assert isinstance(user, SessionUser), "require_console_user guards every page"
    return user


def security_headers(app: ASGIApp) -> ASGIApp:
    """ASGI middleware: CSP without inline script, no framing, no sniffing, on every response but the API docs."""

    async def middleware(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or str(scope.get("path", "")).startswith("/schema"):
            await app(scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                present = {name.lower() for name, _ in message.get("headers", [])}
                extra = [(n, v) for n, v in _SECURITY_HEADERS if n not in present]
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        await app(scope, receive, send_with_headers)

    return middleware
