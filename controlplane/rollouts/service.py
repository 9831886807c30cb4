"""Canary rollouts of model versions to cloud traffic and device fleets, and of escalation policy versions to
device fleets (a rollout's ``kind``: ``model`` or ``policy``; a policy rollout is judged by
:func:`controlplane.rollouts.metrics.policy_window` and its assignment read by
:func:`controlplane.policies.service.desired_rows`).

A rollout moves a candidate version through steps of weight (the candidate's share of subjects, default
5 → 25 → 50 → 100 %) against a baseline version. State machine::

    pending ──start──▶ running(step i) ──advance──▶ running(step i+1) … ──▶ promoted
                         │    ▲                          │
                       pause resume                   rollback (a failed check) ──▶ rolled_back
                         ▼    │
                        paused                 abort (operator, from any non-final state) ──▶ aborted

Every transition is a ``rollout_event`` carrying its reason and the metrics that caused it; operator actions
also write an ``audit_log`` row. Transitions are conditional on the rollout's ``revision``, so two controllers
(or an operator and a controller) never both apply one to the same state.

The controller pass (:func:`run_controller_pass`) reads, for each running rollout, per-arm aggregates over
the window since its step started (:func:`collect_windows`: usage records for cloud traffic, device
telemetry for fleets) and hands them to the pure :func:`analyse`, which answers wait | advance | promote |
rollback. Thin data waits; no data is never a pass.

Who gets which version while a rollout governs a model: :class:`RolloutPlan` snapshots are read by the edge
gateway (:func:`edge_version`, per device) and the cloud (:func:`resolve_cloud_arm`, per request).

This module holds the state machine (spec, transitions, pins, the controller pass); the pure analysis lives in
:mod:`controlplane.rollouts.analysis`, the per-arm aggregates in :mod:`controlplane.rollouts.metrics` and the assignment
snapshots in :mod:`controlplane.rollouts.plans`. Their public names are re-exported here, so
``controlplane.rollouts.service`` stays
the one import for callers.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Final

from sqlalchemy import or_, update
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from controlplane.rollouts.analysis import DEFAULT_CHECKS as DEFAULT_CHECKS
from controlplane.rollouts.analysis import METRICS as METRICS
from controlplane.rollouts.analysis import POLICY_DEFAULT_CHECKS as POLICY_DEFAULT_CHECKS
from controlplane.rollouts.analysis import SOURCE_METRICS as SOURCE_METRICS
from controlplane.rollouts.analysis import Action as Action
from controlplane.rollouts.analysis import ArmStats as ArmStats
from controlplane.rollouts.analysis import CheckResult as CheckResult
from controlplane.rollouts.analysis import Decision as Decision
from controlplane.rollouts.analysis import ShadowStats as ShadowStats
from controlplane.rollouts.analysis import Source as Source
from controlplane.rollouts.analysis import Window as Window
from controlplane.rollouts.analysis import analyse as analyse
from controlplane.rollouts.analysis import analyse_shadow as analyse_shadow
from controlplane.rollouts.analysis import check as check
from controlplane.rollouts.assignment import PIN_VALUES
from controlplane.rollouts.metrics import TELEMETRY_LOOKBACK as TELEMETRY_LOOKBACK
from controlplane.rollouts.metrics import candidate_usage as candidate_usage
from controlplane.rollouts.metrics import collect_windows as collect_windows
from controlplane.rollouts.metrics import policy_window as policy_window
from controlplane.rollouts.metrics import shadow_stats as shadow_stats
from controlplane.rollouts.plans import MODEL_PREFIX as MODEL_PREFIX
from controlplane.rollouts.plans import CloudRoute as CloudRoute
from controlplane.rollouts.plans import RolloutPlan as RolloutPlan
from controlplane.rollouts.plans import edge_version as edge_version
from controlplane.rollouts.plans import load_plans as load_plans
from controlplane.rollouts.plans import load_policy_plans as load_policy_plans
from controlplane.rollouts.plans import model_names as model_names
from controlplane.rollouts.plans import plans_for as plans_for
from controlplane.rollouts.plans import resolve_cloud_arm as resolve_cloud_arm
from controlplane.rollouts.plans import usage_arm as usage_arm
from controlplane.storage.tables import AuditLog, Device, EscalationPolicy, Rollout, RolloutEvent, RolloutPin, Tenant
from shared.edge_protocol import version_number
from shared.errors import ConflictError, NotFoundError, ValidationError

logger = logging.getLogger(__name__)

SCOPES: Final = ("cloud", "edge", "both")
KINDS: Final = ("model", "policy")  # what the versions are: a model's, or an edge model's escalation policy's
ACTIVE: Final = ("pending", "running", "paused")
FINAL: Final = ("promoted", "rolled_back", "aborted")
PIN_KINDS: Final = ("tenant", "device")
DEFAULT_STEPS: Final = (5.0, 25.0, 50.0, 100.0)
MAX_STEPS: Final = 20
_MODEL_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/+-]{0,127}$")
_VERSION_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,63}$")
_LABEL_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,63}$")


def utcnow() -> datetime:
    return datetime.now(UTC)


# --- creating and validating ------------------------------------------------------------------------------------


@dataclass(slots=True)
class RolloutSpec:
    """What an operator asks for; :func:`validate_spec` checks and completes it."""

    model: str
    baseline_version: str
    candidate_version: str
    scope: str = "cloud"
    device_selector: dict[str, str] = field(default_factory=dict)
    steps: list[float] | None = None
    min_step_s: float = 300.0
    min_samples: int = 100
    checks: dict[str, Any] | None = None
    tenant: str | None = None
    shadow_sample: float = 0.0
    shadow_min_agreement: float = 0.9
    kind: str = "model"


def validate_spec(spec: RolloutSpec) -> RolloutSpec:
    """The spec with defaults filled in, or ValidationError naming the field (``param``) that is wrong."""
    if not isinstance(spec.model, str) or not _MODEL_RE.fullmatch(spec.model):
        raise ValidationError("model must be 1-128 letters, digits or '._/+-'", param="model")
    for name in ("baseline_version", "candidate_version"):
        value = getattr(spec, name)
        if not isinstance(value, str) or not _VERSION_RE.fullmatch(value):
            raise ValidationError(f"{name} must be 1-64 letters, digits or '._+-'", param=name)
    if spec.kind not in KINDS:
        raise ValidationError(f"kind must be one of {', '.join(KINDS)}", param="kind")
    scope = spec.scope
    if spec.kind == "policy":
        # A policy version goes to devices: its arms are devices, judged on their telemetry and usage.
        if scope == "both":
            raise ValidationError("a policy rollout goes to devices: scope edge", param="scope")
        scope = "edge"
        for name in ("baseline_version", "candidate_version"):
            if version_number(getattr(spec, name)) is None:
                raise ValidationError(f"{name}: a policy version number such as 3", param=name)
    if spec.baseline_version == spec.candidate_version:
        raise ValidationError(
            f"candidate_version {spec.candidate_version!r} must differ from baseline_version", param="candidate_version"
        )
    if scope not in SCOPES:
        raise ValidationError(f"scope must be one of {', '.join(SCOPES)}", param="scope")
    selector = dict(spec.device_selector or {})
    for key, value in selector.items():
        if not (isinstance(key, str) and isinstance(value, str) and _LABEL_RE.fullmatch(key) and len(value) <= 128):
            raise ValidationError(f"device_selector: bad label {key!r}={value!r}", param="device_selector")
    if selector and scope == "cloud":
        raise ValidationError("device_selector picks devices; a cloud rollout has none", param="device_selector")
    steps = list(DEFAULT_STEPS) if spec.steps is None else spec.steps
    if not steps or len(steps) > MAX_STEPS:
        raise ValidationError(f"steps must list 1-{MAX_STEPS} weights", param="steps")
    clean: list[float] = []
    for step in steps:
        if isinstance(step, bool) or not isinstance(step, int | float) or not math.isfinite(step):
            raise ValidationError(f"steps: {step!r} is not a number", param="steps")
        if not 0 < step <= 100:
            raise ValidationError(f"steps: {step:g} is outside (0, 100]", param="steps")
        if clean and step <= clean[-1]:
            raise ValidationError("steps must be strictly ascending", param="steps")
        clean.append(float(step))
    if isinstance(spec.min_step_s, bool) or not math.isfinite(spec.min_step_s) or spec.min_step_s < 0:
        raise ValidationError("min_step_s must be a non-negative number of seconds", param="min_step_s")
    if isinstance(spec.min_samples, bool) or not isinstance(spec.min_samples, int) or spec.min_samples < 1:
        raise ValidationError("min_samples must be a whole number ≥ 1 (no data is never a pass)", param="min_samples")
    for name in ("shadow_sample", "shadow_min_agreement"):
        value = getattr(spec, name)
        high = 100.0 if name == "shadow_sample" else 1.0
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= high:
            raise ValidationError(f"{name} must be a number in [0, {high:g}]", param=name)
    if spec.shadow_sample > 0:
        if scope != "cloud":
            raise ValidationError("a shadow step mirrors cloud requests: it needs scope cloud", param="shadow_sample")
        clean.insert(0, 0.0)  # step 0, the shadow step: weight 0, a sample of baseline requests mirrored
    return RolloutSpec(
        model=spec.model,
        baseline_version=spec.baseline_version,
        candidate_version=spec.candidate_version,
        scope=scope,
        device_selector=selector,
        steps=clean,
        min_step_s=float(spec.min_step_s),
        min_samples=spec.min_samples,
        checks=validate_checks(spec.checks, kind=spec.kind),
        tenant=spec.tenant,
        shadow_sample=float(spec.shadow_sample),
        shadow_min_agreement=float(spec.shadow_min_agreement),
        kind=spec.kind,
    )


def validate_checks(checks: Mapping[str, Any] | None, *, kind: str = "model") -> dict[str, Any]:
    """Overrides merged over :data:`DEFAULT_CHECKS` (:data:`POLICY_DEFAULT_CHECKS` for a policy rollout);
    ``{"metric": null}`` turns a check off."""
    defaults = POLICY_DEFAULT_CHECKS if kind == "policy" else DEFAULT_CHECKS
    merged: dict[str, Any] = {k: dict(v) for k, v in defaults.items()}
    if checks is None:
        return merged
    if not isinstance(checks, Mapping):
        raise ValidationError("checks must be an object of metric -> {factor, slack}", param="checks")
    for metric, spec in checks.items():
        param = f"checks.{metric}"
        if metric not in METRICS:
            raise ValidationError(f"{param}: unknown check; known: {', '.join(METRICS)}", param=param)
        if spec is None:
            merged[metric] = None
            continue
        if not isinstance(spec, Mapping) or set(spec) - {"factor", "slack"}:
            raise ValidationError(f"{param} must be {{factor, slack}}", param=param)
        factor, slack = spec.get("factor", 1.0), spec.get("slack", 0.0)
        for name, value in (("factor", factor), ("slack", slack)):
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
                raise ValidationError(f"{param}.{name} must be a non-negative number", param=f"{param}.{name}")
        merged[metric] = {"factor": float(factor), "slack": float(slack)}
    return merged


def create_rollout(session: Session, spec: RolloutSpec, *, actor: str) -> Rollout:
    """Validate and store a rollout (``pending``: the controller's next pass starts it)."""
    spec = validate_spec(spec)
    tenant_id: int | None = None
    if spec.tenant is not None:
        tenant = session.exec(select(Tenant).where(Tenant.name == spec.tenant)).first()
        if tenant is None:
            raise ValidationError(f"no tenant named {spec.tenant!r}", param="tenant")
        tenant_id = tenant.id
    if spec.kind == "policy":
        spec.model = _policy_model(session, spec.model, spec.baseline_version, spec.candidate_version)
    scopes = SCOPES if spec.scope == "both" else (spec.scope, "both")
    overlapping = select(Rollout).where(
        col(Rollout.model).in_(model_names(spec.model)),
        col(Rollout.status).in_(ACTIVE),
        col(Rollout.scope).in_(scopes),
        col(Rollout.kind) == spec.kind,
    )
    if tenant_id is not None:  # a platform-wide rollout overlaps every tenant's
        overlapping = overlapping.where(or_(col(Rollout.tenant_id).is_(None), col(Rollout.tenant_id) == tenant_id))
    clash = session.exec(overlapping).first()
    if clash is not None:
        raise ConflictError(
            f"rollout {clash.id} of {spec.model} is {clash.status}; promote or abort it first", param="model"
        )
    assert spec.steps is not None and spec.checks is not None
    now = utcnow()
    rollout = Rollout(
        tenant_id=tenant_id,
        model=spec.model,
        baseline_version=spec.baseline_version,
        candidate_version=spec.candidate_version,
        scope=spec.scope,
        device_selector=spec.device_selector,
        steps=spec.steps,
        min_step_s=spec.min_step_s,
        min_samples=spec.min_samples,
        checks=spec.checks,
        shadow_sample=spec.shadow_sample,
        shadow_min_agreement=spec.shadow_min_agreement,
        kind=spec.kind,
        created_by=actor,
        created_at=now,
        updated_at=now,
    )
    session.add(rollout)
    session.flush()
    _event(session, rollout, "created", None, f"created by {actor}", None, actor)
    _audit(session, actor, "rollout.create", rollout, None, rollout_json(rollout))
    return rollout


def _policy_model(session: Session, model: str, baseline: str, candidate: str) -> str:
    """The stored escalation-policy model id ``model`` names (its full id or last part), once both versions exist."""
    names = set(session.exec(select(EscalationPolicy.model).distinct()).all())
    found = [model] if model in names else sorted(n for n in names if n.rsplit("/", 1)[-1] == model)
    if len(found) != 1:
        what = "no escalation policy for" if not found else "more than one escalation policy matches"
        raise ValidationError(f"model: {what} {model!r}", param="model")
    have = set(session.exec(select(EscalationPolicy.version).where(EscalationPolicy.model == found[0])).all())
    for name, value in (("baseline_version", baseline), ("candidate_version", candidate)):
        if int(value) not in have:
            raise ValidationError(f"{name}: {found[0]} has no policy version {value}", param=name)
    return found[0]


# --- reading ------------------------------------------------------------------------------------------------------


def get_rollout(session: Session, rollout_id: int) -> Rollout:
    rollout = session.get(Rollout, rollout_id, populate_existing=True)
    if rollout is None:
        raise NotFoundError(f"no rollout with id {rollout_id}", param="id")
    return rollout


def list_rollouts(session: Session, status: str | None = None) -> list[Rollout]:
    query = select(Rollout).order_by(col(Rollout.id).desc())
    if status is not None:
        query = query.where(Rollout.status == status)
    return list(session.exec(query))


def rollout_events(session: Session, rollout_id: int) -> list[RolloutEvent]:
    query = select(RolloutEvent).where(RolloutEvent.rollout_id == rollout_id).order_by(col(RolloutEvent.id))
    return list(session.exec(query))


def rollout_pins(session: Session, rollout_id: int) -> list[RolloutPin]:
    query = select(RolloutPin).where(RolloutPin.rollout_id == rollout_id).order_by(col(RolloutPin.id))
    return list(session.exec(query))


def rollout_json(r: Rollout) -> dict[str, Any]:
    def ts(value: datetime | None) -> str | None:
        return value.isoformat() if value is not None else None

    return {
        "id": r.id,
        "kind": r.kind,
        "model": r.model,
        "baseline_version": r.baseline_version,
        "candidate_version": r.candidate_version,
        "scope": r.scope,
        "tenant_id": r.tenant_id,
        "device_selector": r.device_selector,
        "steps": r.steps,
        "step_index": r.step_index,
        "weight": r.weight,
        "status": r.status,
        "min_step_s": r.min_step_s,
        "min_samples": r.min_samples,
        "checks": r.checks,
        "shadow_sample": r.shadow_sample,
        "shadow_min_agreement": r.shadow_min_agreement,
        "last_analysis": r.last_analysis,
        "created_by": r.created_by,
        "created_at": ts(r.created_at),
        "updated_at": ts(r.updated_at),
        "step_started_at": ts(r.step_started_at),
        "finished_at": ts(r.finished_at),
    }


def event_json(e: RolloutEvent) -> dict[str, Any]:
    return {
        "at": e.at.isoformat(),
        "kind": e.kind,
        "from_status": e.from_status,
        "to_status": e.to_status,
        "step_index": e.step_index,
        "weight": e.weight,
        "reason": e.reason,
        "metrics": e.metrics,
        "actor": e.actor,
    }


def pin_json(p: RolloutPin) -> dict[str, Any]:
    return {"kind": p.kind, "key": p.key, "arm": p.arm}


# --- transitions --------------------------------------------------------------------------------------------------

_ALLOWED: Final[dict[str, tuple[str, ...]]] = {
    "started": ("pending",),
    "advanced": ("running",),
    "paused": ("running",),
    "resumed": ("paused", "pending"),
    "promoted": ACTIVE,
    "rolled_back": ("running", "paused"),
    "aborted": ACTIVE,
}


def _transition(
    session: Session,
    rollout: Rollout,
    kind: str,
    *,
    actor: str,
    reason: str,
    metrics: dict[str, Any] | None = None,
    last_analysis: dict[str, Any] | None = None,
    now: datetime | None = None,
) -> Rollout:
    """Apply one transition to ``rollout`` as last read (its ``revision``), write its event, return it fresh.

    The UPDATE is the transaction's first write and is conditional on the revision: if anyone changed the
    rollout since it was read, nothing is written and ConflictError says so.
    """
    if rollout.status not in _ALLOWED[kind]:
        raise ConflictError(f"rollout {rollout.id} is {rollout.status}; it cannot be {kind.replace('_', ' ')}")
    now = now or utcnow()
    values: dict[str, Any] = {"revision": rollout.revision + 1, "updated_at": now}
    steps = rollout.steps
    if kind in ("started", "resumed"):
        values.update(status="running", step_started_at=now)
        if rollout.status == "pending":
            values.update(step_index=0, weight=steps[0])
    elif kind == "advanced":
        values.update(step_index=rollout.step_index + 1, weight=steps[rollout.step_index + 1], step_started_at=now)
    elif kind == "paused":
        values.update(status="paused")
    elif kind == "promoted":
        values.update(status="promoted", weight=100.0, finished_at=now)
    else:  # rolled_back, aborted: the candidate's weight goes to 0 and devices return to the baseline
        values.update(status=kind, weight=0.0, finished_at=now)
    if last_analysis is not None:
        values["last_analysis"] = last_analysis
    result = session.execute(
        update(Rollout)
        .where(col(Rollout.id) == rollout.id, col(Rollout.revision) == rollout.revision)
        .values(**values)
        .execution_options(synchronize_session=False)
    )
    if result.rowcount != 1:  # type: ignore[attr-defined]
        raise ConflictError(f"rollout {rollout.id} changed meanwhile; read it again and retry")
    if kind in ("rolled_back", "aborted") and rollout.kind == "model":  # billed as served: what the candidate served
        metrics = {**(metrics or {}), "candidate_usage": candidate_usage(session, rollout, now)}
    before = rollout.status
    fresh = get_rollout(session, rollout.id or 0)
    _event(session, fresh, kind, before, reason, metrics, actor, now)
    # Every transition is audited where it happens, whoever made it: an operator (CLI, console, API) or the
    # controller (its starts, advances, promotions and rollbacks were missing from the audit log).
    _audit(
        session,
        actor,
        f"rollout.{_ACTIONS[kind]}",
        fresh,
        {"status": before, "step_index": rollout.step_index, "weight": rollout.weight},
        {"status": fresh.status, "step_index": fresh.step_index, "weight": fresh.weight, "reason": reason[:500]},
    )
    return fresh


_ACTIONS = {
    "started": "start",
    "advanced": "advance",
    "paused": "pause",
    "resumed": "resume",
    "promoted": "promote",
    "rolled_back": "rollback",
    "aborted": "abort",
}


def _event(
    session: Session,
    rollout: Rollout,
    kind: str,
    from_status: str | None,
    reason: str,
    metrics: dict[str, Any] | None,
    actor: str,
    at: datetime | None = None,
) -> None:
    assert rollout.id is not None
    session.add(
        RolloutEvent(
            rollout_id=rollout.id,
            at=at or utcnow(),
            kind=kind,
            from_status=from_status,
            to_status=rollout.status,
            step_index=rollout.step_index,
            weight=rollout.weight,
            reason=reason[:2000],
            metrics=metrics,
            actor=actor[:128],
        )
    )


def _audit(
    session: Session, actor: str, action: str, rollout: Rollout, before: dict[str, Any] | None, after: dict[str, Any]
) -> None:
    session.add(AuditLog(actor=actor[:128], action=action, target=f"rollout/{rollout.id}", before=before, after=after))


def _operator(session: Session, rollout_id: int, kind: str, action: str, *, actor: str, reason: str) -> Rollout:
    rollout = get_rollout(session, rollout_id)
    why = f"{action} by {actor}" + (f": {reason}" if reason else "")
    return _transition(session, rollout, kind, actor=actor, reason=why)  # audited there


def pause(session: Session, rollout_id: int, *, actor: str, reason: str = "") -> Rollout:
    """Hold a running rollout at its weight: assignments stay, the controller stops judging it."""
    return _operator(session, rollout_id, "paused", "pause", actor=actor, reason=reason)


def resume(session: Session, rollout_id: int, *, actor: str, reason: str = "") -> Rollout:
    """Run a paused rollout again (its step's window starts afresh), or start a pending one now."""
    return _operator(session, rollout_id, "resumed", "resume", actor=actor, reason=reason)


def promote(session: Session, rollout_id: int, *, actor: str, reason: str = "") -> Rollout:
    """Make the candidate the version for everyone now, skipping the remaining steps."""
    return _operator(session, rollout_id, "promoted", "promote", actor=actor, reason=reason)


def abort(session: Session, rollout_id: int, *, actor: str, reason: str = "") -> Rollout:
    """Stop the rollout: the candidate's weight goes to 0 and everyone returns to the baseline."""
    return _operator(session, rollout_id, "aborted", "abort", actor=actor, reason=reason)


def set_pin(session: Session, rollout_id: int, kind: str, key: str, value: str, *, actor: str) -> RolloutPin:
    """Hold a tenant (by name) or a device (by id) on one arm, or exclude it, for as long as the rollout runs."""
    rollout = get_rollout(session, rollout_id)
    if rollout.status in FINAL:
        raise ConflictError(f"rollout {rollout_id} is {rollout.status}; pins no longer apply")
    if kind not in PIN_KINDS:
        raise ValidationError(f"pin kind must be one of {', '.join(PIN_KINDS)}", param="kind")
    if value not in PIN_VALUES:
        raise ValidationError(f"pin arm must be one of {', '.join(PIN_VALUES)}", param="arm")
    if kind == "tenant":
        tenant = session.exec(select(Tenant).where(Tenant.name == key)).first()
        if tenant is None or (rollout.tenant_id is not None and tenant.id != rollout.tenant_id):
            raise ValidationError(f"no tenant named {key!r} in this rollout", param="key")
    else:
        device = session.get(Device, key)
        if device is None or (rollout.tenant_id is not None and device.tenant_id != rollout.tenant_id):
            raise ValidationError(f"no device {key!r} in this rollout", param="key")
    pin = session.exec(
        select(RolloutPin).where(RolloutPin.rollout_id == rollout_id, RolloutPin.kind == kind, RolloutPin.key == key)
    ).first()
    before = pin_json(pin) if pin is not None else None
    if pin is None:
        pin = RolloutPin(rollout_id=rollout_id, kind=kind, key=key, arm=value)
    pin.arm = value
    session.add(pin)
    session.flush()
    _event(session, rollout, "pinned", rollout.status, f"{kind} {key} pinned to {value} by {actor}", None, actor)
    _audit(session, actor, "rollout.pin", rollout, before, pin_json(pin))
    return pin


def in_shadow_step(rollout: Rollout) -> bool:
    """Whether the rollout is at its shadow step (step 0 at weight 0, a sample of baseline requests mirrored)."""
    return rollout.shadow_sample > 0 and rollout.step_index == 0 and rollout.status in ("running", "paused")


# --- the controller pass --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PassResult:
    """What one controller pass did to one rollout."""

    rollout_id: int
    action: str
    reason: str
    status: str
    step_index: int
    weight: float


def run_controller_pass(engine: Engine, *, now: datetime | None = None, actor: str = "controller") -> list[PassResult]:
    """Start pending rollouts and judge every running one once. One rollout's failure never stops the rest."""
    with Session(engine) as session:
        ids = list(
            session.exec(
                select(Rollout.id).where(col(Rollout.status).in_(("pending", "running"))).order_by(col(Rollout.id))
            )
        )
    results: list[PassResult] = []
    for rollout_id in ids:
        if rollout_id is None:
            continue
        try:
            result = _evaluate(engine, rollout_id, now or utcnow(), actor)
        except ConflictError as exc:
            logger.info("rollout %s: %s", rollout_id, exc.message)
            continue
        except Exception:
            logger.exception("rollout %s: evaluation failed; retried next pass", rollout_id)
            continue
        if result is not None:
            results.append(result)
    return results


def _evaluate(engine: Engine, rollout_id: int, now: datetime, actor: str) -> PassResult | None:
    # Read and aggregate in one transaction, write in another whose first statement is the write: on SQLite
    # a read transaction that later writes fails when another writer (device syncs) committed in between.
    with Session(engine, expire_on_commit=False) as read:
        rollout = read.get(Rollout, rollout_id)
        if rollout is None or rollout.status not in ("pending", "running"):
            return None
        decision: Decision | None = None
        if rollout.status == "running":
            since = rollout.step_started_at or rollout.created_at
            elapsed = max(0.0, (now - since).total_seconds())
            steps = rollout.steps
            nxt = steps[rollout.step_index + 1] if rollout.step_index + 1 < len(steps) else None
            if in_shadow_step(rollout):
                decision = analyse_shadow(
                    shadow_stats(read, rollout_id, since, now),
                    min_agreement=rollout.shadow_min_agreement,
                    min_samples=rollout.min_samples,
                    min_step_s=rollout.min_step_s,
                    step_elapsed_s=elapsed,
                    next_weight=nxt,
                )
            else:
                windows = (
                    [policy_window(read, rollout, since, now)]
                    if rollout.kind == "policy"
                    else collect_windows(read, rollout, since, now)
                )
                decision = analyse(
                    windows,
                    checks=rollout.checks,
                    min_samples=rollout.min_samples,
                    min_step_s=rollout.min_step_s,
                    step_elapsed_s=elapsed,
                    next_weight=nxt,
                )
        read.expunge(rollout)
    with Session(engine, expire_on_commit=False) as write:
        if decision is None:
            fresh = _transition(write, rollout, "started", actor=actor, reason="started by the controller", now=now)
            write.commit()
            return PassResult(rollout_id, "start", "started", fresh.status, fresh.step_index, fresh.weight)
        analysis = {"at": now.isoformat(), "action": decision.action, "reason": decision.reason, **decision.metrics}
        if decision.action == "wait":
            write.execute(
                update(Rollout)
                .where(col(Rollout.id) == rollout_id, col(Rollout.revision) == rollout.revision)
                .values(last_analysis=analysis)
                .execution_options(synchronize_session=False)
            )
            write.commit()
            return PassResult(rollout_id, "wait", decision.reason, rollout.status, rollout.step_index, rollout.weight)
        kind = {"advance": "advanced", "promote": "promoted", "rollback": "rolled_back"}[decision.action]
        fresh = _transition(
            write,
            rollout,
            kind,
            actor=actor,
            reason=decision.reason,
            metrics=decision.metrics,
            last_analysis=analysis,
            now=now,
        )
        write.commit()
        logger.info("rollout %s %s: %s", rollout_id, kind, decision.reason)
        return PassResult(rollout_id, decision.action, decision.reason, fresh.status, fresh.step_index, fresh.weight)
