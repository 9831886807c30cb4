"""The console's management API under ``/api``: console API tokens, the operator behind each call, the routers.

A token (``tlc-`` + 43 url-safe characters) acts as a console user; only its sha256 is stored and the token
is shown once (``tierline console create-token``). Viewers may read; changes need an admin. Errors use the OpenAI
error shape, a 400 names the field (``param``). The routes live with their domain: ``console.rollouts_api``,
``console.registry_api``, ``console.billing_api``.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from litestar import Request, Router
from litestar.di import Provide
from litestar.openapi import OpenAPIConfig
from litestar.openapi.spec import Components, SecurityScheme
from litestar.types import ControllerRouterHandler
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select, update

from controlplane.storage.tables import ConsoleToken, ConsoleUser
from shared.errors import AuthenticationError, NotFoundError, PermissionDeniedError

PREFIX = "tlc-"
TOKEN_BYTES = 32
_LAST_USED_GRANULARITY = timedelta(minutes=5)  # last_used_at is written at most this often per token


def hash_token(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class IssuedToken:
    """A new console API token: ``secret`` is shown once and never stored."""

    record: ConsoleToken
    secret: str


def create_token(session: Session, username: str, *, name: str = "") -> IssuedToken:
    user = session.exec(select(ConsoleUser).where(ConsoleUser.username == username)).first()
    if user is None or user.id is None:
        raise NotFoundError(f"no console user named {username!r}", param="username")
    secret = PREFIX + secrets.token_urlsafe(TOKEN_BYTES)
    record = ConsoleToken(user_id=user.id, name=name, prefix=secret[:10], token_hash=hash_token(secret))
    session.add(record)
    session.flush()
    return IssuedToken(record, secret)


@dataclass(frozen=True, slots=True)
class Operator:
    """Who is calling the management API."""

    username: str
    role: str

    @property
    def actor(self) -> str:
        return f"console:{self.username}"

    def require_admin(self) -> None:
        if self.role != "admin":
            raise PermissionDeniedError(f"console user {self.username} is a {self.role}; changes need an admin")


def authenticate_token(session: Session, secret: str) -> Operator:
    if not secret.startswith(PREFIX):
        raise AuthenticationError("invalid console API token", code="invalid_token")
    row = session.exec(
        select(ConsoleToken, ConsoleUser).join(ConsoleUser).where(ConsoleToken.token_hash == hash_token(secret))
    ).first()
    if row is None:
        raise AuthenticationError("invalid console API token", code="invalid_token")
    token, user = row
    if token.revoked_at is not None:
        raise AuthenticationError("console API token has been revoked", code="invalid_token")
    now = datetime.now(UTC)
    last = token.last_used_at
    if last is None or (last if last.tzinfo else last.replace(tzinfo=UTC)) < now - _LAST_USED_GRANULARITY:
        session.execute(update(ConsoleToken).where(col(ConsoleToken.id) == token.id).values(last_used_at=now))
        session.commit()
    return Operator(user.username, user.role)


def require_operator(request: Request[Any, Any, Any], db: Engine) -> Operator:
    """The caller of the management API, from its ``Authorization: Bearer tlc-...`` console API token."""
    scheme, _, secret = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not secret.strip():
        raise AuthenticationError(
            "missing console API token (Authorization: Bearer tlc-...; tierline console create-token)",
            code="invalid_token",
        )
    with Session(db) as session:
        return authenticate_token(session, secret.strip())


def management_router(route_handlers: Sequence[ControllerRouterHandler], tag: str) -> Router:
    """Routes under ``/api``, each taking the ``operator`` its console API token names."""
    return Router(
        "/api",
        route_handlers=list(route_handlers),
        dependencies={"operator": Provide(require_operator, sync_to_thread=True)},
        security=[{"ConsoleToken": []}],
        tags=[tag],
    )


OPENAPI_CONFIG = OpenAPIConfig(
    title="tierline console API",
    version="1",
    components=Components(
        security_schemes={
            "ConsoleToken": SecurityScheme(
                type="http", scheme="bearer", description="tlc- console API token (tierline console create-token)"
            )
        }
    ),
)
