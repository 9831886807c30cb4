"""The console's management API under ``/api``: rollouts, behind a bearer console API token.

A token (``tlc-`` + 43 url-safe characters) acts as a console user; only its sha256 is stored and the token
is shown once (``tierline console create-token``). Viewers may read; changes need an admin. Handlers are
thin: they validate the body, call one service function in ``controlplane.rollouts.service`` (which writes the rollout
event and the audit_log row) and return the record as JSON. Errors use the OpenAI error shape, a 400 names
the field (``param``).
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from litestar import Request, Router, get, post
from litestar.datastructures import State
from litestar.di import Provide
from litestar.openapi import OpenAPIConfig
from litestar.openapi.spec import Components, SecurityScheme
from pydantic import BaseModel, ConfigDict, Field
from sqlmodel import Session, col, select, update

from controlplane.rollouts import service as rollouts
from controlplane.storage.session import session_scope
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


def require_operator(request: Request[Any, Any, Any], state: State) -> Operator:
    scheme, _, secret = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not secret.strip():
        raise AuthenticationError(
            "missing console API token (Authorization: Bearer tlc-...; tierline console create-token)",
            code="invalid_token",
        )
    with Session(state.engine) as session:
        return authenticate_token(session, secret.strip())


# --- request bodies --------------------------------------------------------------------------------------------


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RolloutCreate(_Body):
    model: str = Field(description="cloud model name, or the edge artifact name for fleets")
    baseline_version: str
    candidate_version: str
    scope: str = Field("cloud", description="cloud | edge | both")
    device_selector: dict[str, str] = Field(default_factory=dict, description="labels a device must carry")
    steps: list[float] | None = Field(None, description="candidate weights in percent (default 5, 25, 50, 100)")
    min_step_s: float = Field(300.0, description="least seconds a step runs before it may advance")
    min_samples: int = Field(100, description="least requests per arm before a step is judged")
    checks: dict[str, Any] | None = Field(None, description="metric -> {factor, slack} or null, over the defaults")
    tenant: str | None = Field(None, description="limit the rollout to one tenant's traffic and devices")
    shadow_sample: float = Field(
        0.0, description="percent of baseline cloud requests mirrored to the candidate at a shadow step 0 (0: none)"
    )
    shadow_min_agreement: float = Field(0.9, description="least mean token agreement for the shadow step to pass")


class RolloutAction(_Body):
    reason: str = Field("", max_length=500)


class PinCreate(_Body):
    kind: str = Field(description="tenant | device")
    key: str = Field(max_length=128, description="tenant name or device id")
    arm: str = Field(description="baseline | candidate | excluded")


# --- routes ------------------------------------------------------------------------------------------------------


def _detail(session: Session, rollout_id: int) -> dict[str, Any]:
    return {
        **rollouts.rollout_json(rollouts.get_rollout(session, rollout_id)),
        "events": [rollouts.event_json(e) for e in rollouts.rollout_events(session, rollout_id)],
        "pins": [rollouts.pin_json(p) for p in rollouts.rollout_pins(session, rollout_id)],
    }


@post("/rollouts", status_code=201, sync_to_thread=True)
def create_rollout(state: State, operator: Operator, data: RolloutCreate) -> dict[str, Any]:
    """Create a rollout; it is ``pending`` until the controller's next pass starts it."""
    operator.require_admin()
    spec = rollouts.RolloutSpec(**data.model_dump())
    with session_scope(state.engine) as session:
        rollout = rollouts.create_rollout(session, spec, actor=operator.actor)
        return _detail(session, rollout.id or 0)


@get("/rollouts", sync_to_thread=True)
def list_rollouts(state: State, operator: Operator, status: str | None = None) -> dict[str, Any]:
    """Rollouts, newest first; ``?status=running`` filters."""
    with Session(state.engine) as session:
        rows = rollouts.list_rollouts(session, status)
        return {"object": "list", "data": [rollouts.rollout_json(r) for r in rows]}


@get("/rollouts/{rollout_id:int}", sync_to_thread=True)
def get_rollout(state: State, operator: Operator, rollout_id: int) -> dict[str, Any]:
    """One rollout with its event timeline and pins."""
    with Session(state.engine) as session:
        return _detail(session, rollout_id)


def _act(state: State, operator: Operator, rollout_id: int, data: RolloutAction | None, action: str) -> dict[str, Any]:
    operator.require_admin()
    do = {
        "pause": rollouts.pause,
        "resume": rollouts.resume,
        "promote": rollouts.promote,
        "abort": rollouts.abort,
    }[action]
    with session_scope(state.engine) as session:
        do(session, rollout_id, actor=operator.actor, reason=data.reason if data else "")
        return _detail(session, rollout_id)


@post("/rollouts/{rollout_id:int}/pause", status_code=200, sync_to_thread=True)
def pause_rollout(
    state: State, operator: Operator, rollout_id: int, data: RolloutAction | None = None
) -> dict[str, Any]:
    """Hold a running rollout at its weight."""
    return _act(state, operator, rollout_id, data, "pause")


@post("/rollouts/{rollout_id:int}/resume", status_code=200, sync_to_thread=True)
def resume_rollout(
    state: State, operator: Operator, rollout_id: int, data: RolloutAction | None = None
) -> dict[str, Any]:
    """Run a paused rollout again (its step starts afresh), or start a pending one now."""
    return _act(state, operator, rollout_id, data, "resume")


@post("/rollouts/{rollout_id:int}/promote", status_code=200, sync_to_thread=True)
def promote_rollout(
    state: State, operator: Operator, rollout_id: int, data: RolloutAction | None = None
) -> dict[str, Any]:
    """Make the candidate everyone's version now."""
    return _act(state, operator, rollout_id, data, "promote")


@post("/rollouts/{rollout_id:int}/abort", status_code=200, sync_to_thread=True)
def abort_rollout(
    state: State, operator: Operator, rollout_id: int, data: RolloutAction | None = None
) -> dict[str, Any]:
    """Stop the rollout; everyone returns to the baseline."""
    return _act(state, operator, rollout_id, data, "abort")


@post("/rollouts/{rollout_id:int}/pins", status_code=200, sync_to_thread=True)
def pin_rollout(state: State, operator: Operator, rollout_id: int, data: PinCreate) -> dict[str, Any]:
    """Hold a tenant or device on one arm, or exclude it."""
    operator.require_admin()
    with session_scope(state.engine) as session:
        rollouts.set_pin(session, rollout_id, data.kind, data.key, data.arm, actor=operator.actor)
        return _detail(session, rollout_id)


API_ROUTER = Router(
    "/api",
    route_handlers=[
        create_rollout,
        list_rollouts,
        get_rollout,
        pause_rollout,
        resume_rollout,
        promote_rollout,
        abort_rollout,
        pin_rollout,
    ],
    dependencies={"operator": Provide(require_operator, sync_to_thread=True)},
    security=[{"ConsoleToken": []}],
    tags=["management"],
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
