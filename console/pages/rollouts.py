"""Rollouts: list, create, detail (steps, checks, events), pause / resume / promote / abort.

Every change goes through :mod:`controlplane.rollouts.service`, which writes the rollout event and the audit_log row.
"""

from __future__ import annotations

from typing import Any

from litestar import Request, get, post
from litestar.response import Redirect, Template
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from console.auth import session_user
from console.pages import changes
from console.pages.charts import check_bars
from console.pages.common import (
    Form,
    errors_of,
    labels,
    optional_float,
    optional_int,
    paginate,
    render,
    see_other,
    text,
    write_session,
)
from controlplane.rollouts import service as rollouts
from controlplane.storage.tables import Rollout, Tenant
from shared.errors import ApplicationError, NotFoundError, ValidationError

STATUSES = ("pending", "running", "paused", "promoted", "rolled_back", "aborted")
ACTIONS = {
    "pause": (rollouts.pause, "Pause", "The candidate keeps its weight; the controller stops judging the step."),
    "resume": (rollouts.resume, "Resume", "The step's window starts afresh."),
    "promote": (rollouts.promote, "Promote", "The candidate becomes everyone's version now, skipping the steps left."),
    "abort": (rollouts.abort, "Abort", "The candidate's weight goes to 0 and everyone returns to the baseline."),
}
CONFIRMED = ("promote", "abort")  # final: the page asks first


def _steps(form: dict[str, str]) -> list[float] | None:
    raw = form.get("steps", "").strip()
    if not raw:
        return None
    try:
        return [float(part) for part in raw.replace(" ", "").split(",") if part]
    except ValueError:
        raise ValidationError(
            "steps: write weights in percent separated by commas, e.g. 5, 25, 50, 100", param="steps"
        ) from None


def _spec(form: dict[str, str]) -> rollouts.RolloutSpec:
    return rollouts.RolloutSpec(
        model=text(form, "model", max_length=128, required=True),
        baseline_version=text(form, "baseline_version", max_length=64, required=True),
        candidate_version=text(form, "candidate_version", max_length=64, required=True),
        scope=form.get("scope", "cloud"),
        device_selector=labels(form, "device_selector"),
        steps=_steps(form),
        min_step_s=optional_float(form, "min_step_s", maximum=30 * 86400) or 300.0,
        min_samples=optional_int(form, "min_samples", minimum=1) or 100,
        tenant=text(form, "tenant", max_length=64) or None,
        kind=form.get("kind") or "model",
    )


@get("/rollouts", sync_to_thread=True)
def rollouts_list(request: Request[Any, Any, Any], db: Engine, status: str = "", page: int = 1) -> Template:
    """Rollouts, newest first; filter by status."""
    query = select(Rollout).order_by(col(Rollout.id).desc())
    if status in STATUSES:
        query = query.where(Rollout.status == status)
    with Session(db) as session:
        rows, info = paginate(session, query, page, {"status": status})
    return render(request, "rollouts.html.j2", rollouts=rows, page=info, status=status, statuses=STATUSES)


def _form_page(
    request: Request[Any, Any, Any], db: Engine, form: dict[str, str], errors: dict[str, str], status_code: int = 200
) -> Template:
    with Session(db) as session:
        tenants = changes.tenant_names(session)
    return render(
        request,
        "rollout_form.html.j2",
        status_code,
        form=form,
        errors=errors,
        tenants=tenants,
        scopes=rollouts.SCOPES,
        kinds=rollouts.KINDS,
    )


@get("/rollouts/new", sync_to_thread=True)
def rollout_new(
    request: Request[Any, Any, Any],
    db: Engine,
    kind: str = "model",
    model: str = "",
    baseline: str = "",
    candidate: str = "",
) -> Template:
    """The form; ``?kind=policy&model=…&baseline=…&candidate=…`` fills it in (a policy's page links here)."""
    policy = kind == "policy"
    form = {
        "kind": "policy" if policy else "model",
        "model": model[:128],
        "baseline_version": baseline[:64],
        "candidate_version": candidate[:64],
        "scope": "edge" if policy else "cloud",
        "steps": "20, 100" if policy else "5, 25, 50, 100",
        "min_step_s": "300",
        "min_samples": "100",
    }
    return _form_page(request, db, form, {})


@post("/rollouts", sync_to_thread=True)
def rollout_create(request: Request[Any, Any, Any], db: Engine, data: Form) -> Template | Redirect:
    """Create a rollout; it is pending until the controller's next pass (or Resume) starts it."""
    user = session_user(request)
    try:
        spec = _spec(data)
        with write_session(db) as session:
            rollout = rollouts.create_rollout(session, spec, actor=user.actor)
    except ApplicationError as exc:
        return _form_page(request, db, data, errors_of(exc), 400)
    return see_other(f"/rollouts/{rollout.id}")


def _detail(db: Engine, rollout_id: int) -> dict[str, Any]:
    with Session(db) as session:
        rollout = rollouts.get_rollout(session, rollout_id)
        events = rollouts.rollout_events(session, rollout_id)
        pins = rollouts.rollout_pins(session, rollout_id)
        tenant = session.get(Tenant, rollout.tenant_id) if rollout.tenant_id else None
    analysis = rollout.last_analysis or {}
    return {
        "rollout": rollout,
        "events": list(reversed(events)),
        "pins": pins,
        "tenant": tenant,
        "analysis": analysis,
        "checks": check_bars(analysis.get("checks") or []),
        "is_active": rollout.status in rollouts.ACTIVE,
    }


@get("/rollouts/{rollout_id:int}", sync_to_thread=True)
def rollout_detail(request: Request[Any, Any, Any], db: Engine, rollout_id: int) -> Template:
    """Step progress, the last analysis's checks (candidate vs baseline), the event timeline, actions."""
    return render(request, "rollout.html.j2", **_detail(db, rollout_id))


@get("/rollouts/{rollout_id:int}/live", sync_to_thread=True)
def rollout_live(request: Request[Any, Any, Any], db: Engine, rollout_id: int) -> Template:
    """The changing part of the detail page, polled every 5 s while the rollout is active."""
    return render(request, "partials/rollout_live.html.j2", **_detail(db, rollout_id))


@get("/rollouts/{rollout_id:int}/{action:str}", sync_to_thread=True)
def rollout_action_confirm(request: Request[Any, Any, Any], db: Engine, rollout_id: int, action: str) -> Template:
    """Asks before promoting or aborting (both are final)."""
    if action not in ACTIONS:
        raise NotFoundError(f"no rollout action {action!r}", param="action")
    with Session(db) as session:
        rollout = rollouts.get_rollout(session, rollout_id)
    _, label, effect = ACTIONS[action]
    return render(
        request,
        "confirm.html.j2",
        title=f"{label} rollout {rollout_id} of {rollout.model}",
        message=f"{effect} ({rollout.baseline_version} → {rollout.candidate_version}, now {rollout.status} at "
        f"{rollout.weight:g} %.)",
        action=f"/rollouts/{rollout_id}/{action}",
        button=f"{label} rollout",
        cancel=f"/rollouts/{rollout_id}",
        reason=True,
    )


@post("/rollouts/{rollout_id:int}/{action:str}", sync_to_thread=True)
def rollout_action(request: Request[Any, Any, Any], db: Engine, rollout_id: int, action: str, data: Form) -> Redirect:
    """Pause, resume, promote or abort; a transition the rollout's state does not allow is a 409."""
    if action not in ACTIONS:
        raise NotFoundError(f"no rollout action {action!r}", param="action")
    do, _, _ = ACTIONS[action]
    reason = text(data, "reason", max_length=500)
    with write_session(db) as session:
        do(session, rollout_id, actor=session_user(request).actor, reason=reason)
    return see_other(f"/rollouts/{rollout_id}")


HANDLERS = [
    rollouts_list,
    rollout_new,
    rollout_create,
    rollout_detail,
    rollout_live,
    rollout_action_confirm,
    rollout_action,
]
