"""The console's rollout API under ``/api``, behind a console API token (``console.management_api``).

Handlers are thin: they validate the body, call one service function in ``controlplane.rollouts.service`` (which
writes the rollout event and the audit_log row) and return the record as JSON.
"""

from __future__ import annotations

from typing import Any

from litestar import get, post
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy.engine import Engine
from sqlmodel import Session

from console.management_api import Operator, management_router
from controlplane.rollouts import service as rollouts
from controlplane.storage.session import session_scope

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
    kind: str = Field(
        "model",
        description="model: versions of a model; policy: escalation policy versions of the edge model ``model`` "
        "(scope edge; judged on escalation rate, cost per request, errors and p95)",
    )


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
def create_rollout(db: Engine, operator: Operator, data: RolloutCreate) -> dict[str, Any]:
    """Create a rollout; it is ``pending`` until the controller's next pass starts it."""
    operator.require_admin()
    spec = rollouts.RolloutSpec(**data.model_dump())
    with session_scope(db) as session:
        rollout = rollouts.create_rollout(session, spec, actor=operator.actor)
        return _detail(session, rollout.id or 0)


@get("/rollouts", sync_to_thread=True)
def list_rollouts(db: Engine, operator: Operator, status: str | None = None) -> dict[str, Any]:
    """Rollouts, newest first; ``?status=running`` filters."""
    with Session(db) as session:
        rows = rollouts.list_rollouts(session, status)
        return {"object": "list", "data": [rollouts.rollout_json(r) for r in rows]}


@get("/rollouts/{rollout_id:int}", sync_to_thread=True)
def get_rollout(db: Engine, operator: Operator, rollout_id: int) -> dict[str, Any]:
    """One rollout with its event timeline and pins."""
    with Session(db) as session:
        return _detail(session, rollout_id)


def _act(db: Engine, operator: Operator, rollout_id: int, data: RolloutAction | None, action: str) -> dict[str, Any]:
    operator.require_admin()
    do = {
        "pause": rollouts.pause,
        "resume": rollouts.resume,
        "promote": rollouts.promote,
        "abort": rollouts.abort,
    }[action]
    with session_scope(db) as session:
        do(session, rollout_id, actor=operator.actor, reason=data.reason if data else "")
        return _detail(session, rollout_id)


@post("/rollouts/{rollout_id:int}/pause", status_code=200, sync_to_thread=True)
def pause_rollout(db: Engine, operator: Operator, rollout_id: int, data: RolloutAction | None = None) -> dict[str, Any]:
    """Hold a running rollout at its weight."""
    return _act(db, operator, rollout_id, data, "pause")


@post("/rollouts/{rollout_id:int}/resume", status_code=200, sync_to_thread=True)
def resume_rollout(
    db: Engine, operator: Operator, rollout_id: int, data: RolloutAction | None = None
) -> dict[str, Any]:
    """Run a paused rollout again (its step starts afresh), or start a pending one now."""
    return _act(db, operator, rollout_id, data, "resume")


@post("/rollouts/{rollout_id:int}/promote", status_code=200, sync_to_thread=True)
def promote_rollout(
    db: Engine, operator: Operator, rollout_id: int, data: RolloutAction | None = None
) -> dict[str, Any]:
    """Make the candidate everyone's version now."""
    return _act(db, operator, rollout_id, data, "promote")


@post("/rollouts/{rollout_id:int}/abort", status_code=200, sync_to_thread=True)
def abort_rollout(db: Engine, operator: Operator, rollout_id: int, data: RolloutAction | None = None) -> dict[str, Any]:
    """Stop the rollout; everyone returns to the baseline."""
    return _act(db, operator, rollout_id, data, "abort")


@post("/rollouts/{rollout_id:int}/pins", status_code=200, sync_to_thread=True)
def pin_rollout(db: Engine, operator: Operator, rollout_id: int, data: PinCreate) -> dict[str, Any]:
    """Hold a tenant or device on one arm, or exclude it."""
    operator.require_admin()
    with session_scope(db) as session:
        rollouts.set_pin(session, rollout_id, data.kind, data.key, data.arm, actor=operator.actor)
        return _detail(session, rollout_id)


ROLLOUTS_ROUTER = management_router(
    [
        create_rollout,
        list_rollouts,
        get_rollout,
        pause_rollout,
        resume_rollout,
        promote_rollout,
        abort_rollout,
        pin_rollout,
    ],
    "management",
)
