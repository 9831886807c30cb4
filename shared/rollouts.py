"""Canary rollouts of model versions to cloud traffic and device fleets.

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
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any, Final, Literal

from sqlalchemy import and_, case, func, or_, update
from sqlalchemy import select as sa_select
from sqlalchemy.engine import Engine
from sqlalchemy.sql.elements import ColumnElement
from sqlmodel import Session, col, select

from shared.assignment import BASELINE, CANDIDATE, EXCLUDED, PIN_VALUES, Arm, arm, cloud_subject, fleet_subject
from shared.errors import ConflictError, NotFoundError, ValidationError
from shared.storage.models import AuditLog, Device, DeviceEvent, Rollout, RolloutEvent, RolloutPin, Tenant, UsageRecord

logger = logging.getLogger(__name__)

Action = Literal["wait", "advance", "promote", "rollback"]
Source = Literal["cloud", "edge"]

SCOPES: Final = ("cloud", "edge", "both")
ACTIVE: Final = ("pending", "running", "paused")
FINAL: Final = ("promoted", "rolled_back", "aborted")
PIN_KINDS: Final = ("tenant", "device")
DEFAULT_STEPS: Final = (5.0, 25.0, 50.0, 100.0)
MAX_STEPS: Final = 20
METRICS: Final = ("error_rate", "p95_latency_ms", "p95_ttft_ms", "escalation_rate", "cost_per_request")
DEFAULT_CHECKS: Final[dict[str, dict[str, float]]] = {
    "error_rate": {"factor": 1.2, "slack": 0.005},
    "p95_latency_ms": {"factor": 1.3, "slack": 0.0},
    "escalation_rate": {"factor": 1.2, "slack": 0.02},
}
# What each source can measure: the cloud has no escalations, telemetry has no TTFT or cost.
SOURCE_METRICS: Final[dict[str, frozenset[str]]] = {
    "cloud": frozenset({"error_rate", "p95_latency_ms", "p95_ttft_ms", "cost_per_request"}),
    "edge": frozenset({"error_rate", "p95_latency_ms", "escalation_rate"}),
}
MODEL_PREFIX: Final = "tierline/"
TELEMETRY_LOOKBACK: Final = timedelta(minutes=15)  # how far back a device's last sample before a window is sought
_MODEL_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/+-]{0,127}$")
_VERSION_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,63}$")
_LABEL_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,63}$")


def utcnow() -> datetime:
    return datetime.now(UTC)


def _aware(ts: datetime) -> datetime:
    """SQLite returns naive datetimes; every stored timestamp is UTC."""
    return ts if ts.tzinfo else ts.replace(tzinfo=UTC)


# --- analysis: a pure function over per-arm aggregates ---------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ArmStats:
    """One arm's aggregates over a window. ``None`` means the source does not know (never zero)."""

    requests: int = 0
    errors: int = 0
    p95_latency_ms: float | None = None
    p95_ttft_ms: float | None = None
    escalations: int | None = None
    cost: Decimal | None = None
    num_priced: int = 0
    num_devices: int | None = None

    def value(self, metric: str) -> float | Decimal | None:
        if metric == "error_rate":
            return self.errors / self.requests if self.requests else None
        if metric == "escalation_rate":
            return self.escalations / self.requests if self.requests and self.escalations is not None else None
        if metric == "cost_per_request":
            return self.cost / self.num_priced if self.cost is not None and self.num_priced else None
        if metric == "p95_latency_ms":
            return self.p95_latency_ms
        if metric == "p95_ttft_ms":
            return self.p95_ttft_ms
        raise ValueError(f"unknown metric {metric!r}")

    def as_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"requests": self.requests, "errors": self.errors}
        for metric in METRICS:
            value = self.value(metric)
            if value is not None:
                out[metric] = str(value) if isinstance(value, Decimal) else round(value, 6)
        if self.num_devices is not None:
            out["devices"] = self.num_devices
        return out


@dataclass(frozen=True, slots=True)
class Window:
    """Both arms of one metrics source over the same window."""

    source: Source
    baseline: ArmStats
    candidate: ArmStats


@dataclass(frozen=True, slots=True)
class CheckResult:
    source: Source
    metric: str
    baseline: float | Decimal | None
    candidate: float | Decimal | None
    limit: float | Decimal | None
    outcome: Literal["pass", "fail", "unknown"]

    def describe(self) -> str:
        if self.outcome == "unknown":
            side = "baseline" if self.baseline is None else "candidate"
            return f"{self.source} {self.metric}: no data for the {side}"
        verb = "exceeds" if self.outcome == "fail" else "within"
        values = f"{_fmt(self.candidate)} {verb} limit {_fmt(self.limit)} (baseline {_fmt(self.baseline)})"
        return f"{self.source} {self.metric} {values}"

    def as_json(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "metric": self.metric,
            "baseline": _jsonable(self.baseline),
            "candidate": _jsonable(self.candidate),
            "limit": _jsonable(self.limit),
            "outcome": self.outcome,
        }


@dataclass(frozen=True, slots=True)
class Decision:
    action: Action
    reason: str
    metrics: dict[str, Any]


def _fmt(value: float | Decimal | None) -> str:
    if value is None:
        return "n/a"
    return str(value) if isinstance(value, Decimal) else f"{value:.4g}"


def _jsonable(value: float | Decimal | None) -> Any:
    return str(value) if isinstance(value, Decimal) else value


def check(window: Window, metric: str, spec: Mapping[str, float]) -> CheckResult:
    """Candidate <= baseline * factor + slack, on one metric of one window."""
    base, cand = window.baseline.value(metric), window.candidate.value(metric)
    if base is None or cand is None:
        return CheckResult(window.source, metric, base, cand, None, "unknown")
    limit: float | Decimal
    if isinstance(base, Decimal) or isinstance(cand, Decimal):
        limit = Decimal(base) * Decimal(str(spec["factor"])) + Decimal(str(spec["slack"]))
        ok = Decimal(cand) <= limit
    else:
        limit = base * spec["factor"] + spec["slack"]
        ok = cand <= limit + 1e-12
    return CheckResult(window.source, metric, base, cand, limit, "pass" if ok else "fail")


def analyse(
    windows: Sequence[Window],
    *,
    checks: Mapping[str, Mapping[str, float] | None],
    min_samples: int,
    min_step_s: float,
    step_elapsed_s: float,
    next_weight: float | None,
) -> Decision:
    """Judge one step: ``rollback`` on any failed check, ``wait`` while data is thin or a check has no data or
    the step is younger than ``min_step_s``, else ``advance`` (or ``promote`` when the next weight is 100 % or
    there is no next step).

    A window is judged only once both arms have ``min_samples`` requests (``min_samples`` ≥ 1), so an empty
    window can never pass. ``next_weight`` is the following step's weight, None on the last step.
    """
    assert min_samples >= 1, "min_samples is validated at creation"
    results: list[CheckResult] = []
    thin: list[str] = []
    for window in windows:
        short = [
            f"{window.source} {name} {stats.requests}/{min_samples} requests"
            for name, stats in ((BASELINE, window.baseline), (CANDIDATE, window.candidate))
            if stats.requests < min_samples
        ]
        if short:
            thin.extend(short)
            continue
        results.extend(
            check(window, metric, spec)
            for metric, spec in checks.items()
            if spec is not None and metric in SOURCE_METRICS[window.source]
        )
    metrics: dict[str, Any] = {
        "step_elapsed_s": round(step_elapsed_s, 3),
        "windows": {w.source: {BASELINE: w.baseline.as_json(), CANDIDATE: w.candidate.as_json()} for w in windows},
        "checks": [r.as_json() for r in results],
    }
    failed = [r for r in results if r.outcome == "fail"]
    if failed:
        return Decision("rollback", "check failed: " + "; ".join(r.describe() for r in failed), metrics)
    if not windows:
        return Decision("wait", "no metrics source for this rollout's scope", metrics)
    if thin:
        return Decision("wait", "waiting for data: " + ", ".join(thin), metrics)
    unknown = [r for r in results if r.outcome == "unknown"]
    if unknown:
        return Decision("wait", "waiting for data: " + "; ".join(r.describe() for r in unknown), metrics)
    if step_elapsed_s < min_step_s:
        return Decision("wait", f"checks pass; step has run {step_elapsed_s:.0f}s of {min_step_s:g}s", metrics)
    passed = "; ".join(r.describe() for r in results) or f"{min_samples}+ requests per arm"
    if next_weight is None or next_weight >= 100:
        return Decision("promote", f"every step passed: {passed}", metrics)
    return Decision("advance", f"step passed: {passed}", metrics)


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


def validate_spec(spec: RolloutSpec) -> RolloutSpec:
    """The spec with defaults filled in, or ValidationError naming the field (``param``) that is wrong."""
    if not isinstance(spec.model, str) or not _MODEL_RE.fullmatch(spec.model):
        raise ValidationError("model must be 1-128 letters, digits or '._/+-'", param="model")
    for name in ("baseline_version", "candidate_version"):
        value = getattr(spec, name)
        if not isinstance(value, str) or not _VERSION_RE.fullmatch(value):
            raise ValidationError(f"{name} must be 1-64 letters, digits or '._+-'", param=name)
    if spec.baseline_version == spec.candidate_version:
        raise ValidationError(
            f"candidate_version {spec.candidate_version!r} must differ from baseline_version", param="candidate_version"
        )
    if spec.scope not in SCOPES:
        raise ValidationError(f"scope must be one of {', '.join(SCOPES)}", param="scope")
    selector = dict(spec.device_selector or {})
    for key, value in selector.items():
        if not (isinstance(key, str) and isinstance(value, str) and _LABEL_RE.fullmatch(key) and len(value) <= 128):
            raise ValidationError(f"device_selector: bad label {key!r}={value!r}", param="device_selector")
    if selector and spec.scope == "cloud":
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
    return RolloutSpec(
        model=spec.model,
        baseline_version=spec.baseline_version,
        candidate_version=spec.candidate_version,
        scope=spec.scope,
        device_selector=selector,
        steps=clean,
        min_step_s=float(spec.min_step_s),
        min_samples=spec.min_samples,
        checks=validate_checks(spec.checks),
        tenant=spec.tenant,
    )


def validate_checks(checks: Mapping[str, Any] | None) -> dict[str, Any]:
    """Overrides merged over :data:`DEFAULT_CHECKS`; ``{"metric": null}`` turns a check off."""
    merged: dict[str, Any] = {k: dict(v) for k, v in DEFAULT_CHECKS.items()}
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
    scopes = SCOPES if spec.scope == "both" else (spec.scope, "both")
    overlapping = select(Rollout).where(
        col(Rollout.model).in_(model_names(spec.model)), col(Rollout.status).in_(ACTIVE), col(Rollout.scope).in_(scopes)
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
        created_by=actor,
        created_at=now,
        updated_at=now,
    )
    session.add(rollout)
    session.flush()
    _event(session, rollout, "created", None, f"created by {actor}", None, actor)
    _audit(session, actor, "rollout.create", rollout, None, rollout_json(rollout))
    return rollout


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
        return _aware(value).isoformat() if value is not None else None

    return {
        "id": r.id,
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
        "last_analysis": r.last_analysis,
        "created_by": r.created_by,
        "created_at": ts(r.created_at),
        "updated_at": ts(r.updated_at),
        "step_started_at": ts(r.step_started_at),
        "finished_at": ts(r.finished_at),
    }


def event_json(e: RolloutEvent) -> dict[str, Any]:
    return {
        "at": _aware(e.at).isoformat(),
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
    before = rollout.status
    fresh = get_rollout(session, rollout.id or 0)
    _event(session, fresh, kind, before, reason, metrics, actor, now)
    return fresh


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
    before = {"status": rollout.status, "step_index": rollout.step_index, "weight": rollout.weight}
    why = f"{action} by {actor}" + (f": {reason}" if reason else "")
    fresh = _transition(session, rollout, kind, actor=actor, reason=why)
    after = {"status": fresh.status, "step_index": fresh.step_index, "weight": fresh.weight}
    _audit(session, actor, f"rollout.{action}", fresh, before, after)
    return fresh


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


# --- who gets which version -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RolloutPlan:
    """A snapshot of the rollout that governs a model, enough to assign any device or request to a version."""

    id: int
    model: str
    baseline_version: str
    candidate_version: str
    scope: str
    status: str
    weight: float
    tenant_id: int | None
    device_selector: Mapping[str, str]
    device_pins: Mapping[str, str]
    tenant_pins: Mapping[int, str]
    finished_at: datetime | None

    def version(self, which: Arm) -> str:
        return self.candidate_version if which == CANDIDATE else self.baseline_version

    def selects(self, labels: Mapping[str, str]) -> bool:
        return all(labels.get(k) == v for k, v in self.device_selector.items())


@dataclass(frozen=True, slots=True)
class CloudRoute:
    """Which version serves a cloud request; ``arm`` is stamped on its usage record (None: not in the canary)."""

    rollout_id: int
    arm: Arm | None
    version: str


def model_names(model: str) -> tuple[str, ...]:
    """The names a model goes by on the wire: the artifact name and its ``tierline/`` model id."""
    bare = model.removeprefix(MODEL_PREFIX)
    return (bare, MODEL_PREFIX + bare)


def load_plans(session: Session, target: Source) -> list[RolloutPlan]:
    """The newest rollout per model (and tenant) whose scope covers ``target``, with its pins.

    The newest governs, whatever its state: pending or active rollouts hold the model, a finished one
    decides the outcome (the edge lets a later publish override a finished rollout, see edge_releases).
    """
    newest = (
        select(func.max(Rollout.id))
        .where(col(Rollout.scope).in_((target, "both")))
        .group_by(col(Rollout.model), col(Rollout.tenant_id))
    )
    rollouts = list(session.exec(select(Rollout).where(col(Rollout.id).in_(newest))))
    if not rollouts:
        return []
    ids = [r.id for r in rollouts]
    pins = list(session.exec(select(RolloutPin).where(col(RolloutPin.rollout_id).in_(ids))))
    tenant_names = {p.key for p in pins if p.kind == "tenant"}
    tenant_ids: dict[str, int] = {}
    if tenant_names:
        rows = session.exec(select(Tenant.name, Tenant.id).where(col(Tenant.name).in_(tenant_names)))
        tenant_ids = {name: tid for name, tid in rows if tid is not None}
    return [
        RolloutPlan(
            id=r.id or 0,
            model=r.model,
            baseline_version=r.baseline_version,
            candidate_version=r.candidate_version,
            scope=r.scope,
            status=r.status,
            weight=r.weight,
            tenant_id=r.tenant_id,
            device_selector=dict(r.device_selector),
            device_pins={p.key: p.arm for p in pins if p.rollout_id == r.id and p.kind == "device"},
            tenant_pins={
                tenant_ids[p.key]: p.arm
                for p in pins
                if p.rollout_id == r.id and p.kind == "tenant" and p.key in tenant_ids
            },
            finished_at=_aware(r.finished_at) if r.finished_at is not None else None,
        )
        for r in rollouts
    ]


def plans_for(plans: Iterable[RolloutPlan], model: str, tenant_id: int) -> RolloutPlan | None:
    """The plan that governs ``model`` for a tenant: the newest of the tenant's own and the platform-wide."""
    names = model_names(model)
    mine = [p for p in plans if p.model.removeprefix(MODEL_PREFIX) == names[0] and p.tenant_id in (None, tenant_id)]
    return max(mine, key=lambda p: p.id, default=None)


def edge_version(plan: RolloutPlan, device_id: str, tenant_id: int, labels: Mapping[str, str]) -> str:
    """The version a device should run while ``plan`` governs its model.

    Pending: baseline (creating a rollout freezes the fleet). Running or paused: the device's sticky arm if
    the selector picks it, else baseline. Promoted: candidate for all. Rolled back or aborted: baseline.
    """
    if plan.status == "promoted":
        return plan.candidate_version
    if plan.status not in ("running", "paused") or not plan.selects(labels):
        return plan.baseline_version
    pin = plan.device_pins.get(device_id) or plan.tenant_pins.get(tenant_id)
    subject = fleet_subject(device_id)
    return plan.version(arm(plan.id, subject, plan.weight, {subject: pin} if pin else None))


def resolve_cloud_arm(
    plans: Iterable[RolloutPlan], *, model: str, tenant_id: int, subject: str | None
) -> CloudRoute | None:
    """Which version of ``model`` serves a cloud request, or None when no rollout governs it (serve as today).

    ``plans`` come from ``load_plans(session, "cloud")`` (cache them for a few seconds on the hot path);
    ``subject`` is the request's ``user`` field or its ``x-tierline-subject`` header. Sticky by tenant +
    subject; a tenant pin holds or excludes the whole tenant. Stamp ``route.arm`` as the usage record's
    ``rollout_arm`` and ``route.version`` as its ``model_version``.
    """
    plan = plans_for(plans, model, tenant_id)
    if plan is None:
        return None
    if plan.status == "promoted":
        return CloudRoute(plan.id, None, plan.candidate_version)
    if plan.status not in ("running", "paused"):
        return CloudRoute(plan.id, None, plan.baseline_version)
    pin = plan.tenant_pins.get(tenant_id)
    if pin == EXCLUDED:
        return CloudRoute(plan.id, None, plan.baseline_version)
    key = cloud_subject(str(tenant_id), subject)
    which = arm(plan.id, key, plan.weight, {key: pin} if pin else None)
    return CloudRoute(plan.id, which, plan.version(which))


def usage_arm(plans: Iterable[RolloutPlan], *, model: str, tenant_id: int, version: str | None) -> Arm | None:
    """The arm to stamp on a usage record served by ``version`` of ``model`` (edge records at ingestion).

    By the version that served it, under the rollout that governs the model for the tenant, whatever that
    rollout's state: a record that arrives after a rollback (a device that was offline) still says it was
    served by the candidate. None when no rollout governs the model or the version is neither arm's.
    """
    plan = plans_for(plans, model, tenant_id)
    if plan is None or version is None:
        return None
    if version == plan.candidate_version:
        return CANDIDATE
    if version == plan.baseline_version:
        return BASELINE
    return None


# --- metrics: per-arm aggregates from usage records and device telemetry ---------------------------------------


def collect_windows(session: Session, rollout: Rollout, since: datetime, now: datetime) -> list[Window]:
    """Per-arm aggregates since ``since`` for each source the rollout's scope covers."""
    pins = rollout_pins(session, rollout.id or 0)
    excluded_tenants = [p.key for p in pins if p.kind == "tenant" and p.arm == EXCLUDED]
    excluded_tenant_ids: list[int] = []
    if excluded_tenants:
        rows = session.exec(select(Tenant.id).where(col(Tenant.name).in_(excluded_tenants)))
        excluded_tenant_ids = [tid for tid in rows if tid is not None]
    windows: list[Window] = []
    if rollout.scope in ("cloud", "both"):
        windows.append(
            Window(
                "cloud",
                _cloud_arm_stats(session, rollout, BASELINE, since, now, excluded_tenant_ids),
                _cloud_arm_stats(session, rollout, CANDIDATE, since, now, excluded_tenant_ids),
            )
        )
    if rollout.scope in ("edge", "both"):
        excluded_devices = {p.key for p in pins if p.kind == "device" and p.arm == EXCLUDED}
        windows.append(_edge_window(session, rollout, since, now, excluded_devices, set(excluded_tenant_ids)))
    return windows


def _cloud_arm_condition(rollout: Rollout, which: Arm) -> ColumnElement[bool]:
    stamped = col(UsageRecord.rollout_arm) == which
    version = rollout.candidate_version if which == CANDIDATE else rollout.baseline_version
    if not (rollout.baseline_version.isdigit() and rollout.candidate_version.isdigit()):
        return stamped
    # Records the cloud stamped with a version but no arm count by version.
    by_version = and_(col(UsageRecord.rollout_arm).is_(None), col(UsageRecord.model_version) == int(version))
    return or_(stamped, by_version)


def _cloud_arm_stats(
    session: Session, rollout: Rollout, which: Arm, since: datetime, now: datetime, excluded_tenant_ids: list[int]
) -> ArmStats:
    where: list[ColumnElement[bool]] = [
        col(UsageRecord.model).in_(model_names(rollout.model)),
        col(UsageRecord.tier) == "cloud",
        col(UsageRecord.occurred_at) >= since,
        col(UsageRecord.occurred_at) <= now,
        _cloud_arm_condition(rollout, which),
    ]
    if rollout.tenant_id is not None:
        where.append(col(UsageRecord.tenant_id) == rollout.tenant_id)
    if excluded_tenant_ids:
        where.append(col(UsageRecord.tenant_id).not_in(excluded_tenant_ids))
    is_error = func.coalesce(func.sum(case((col(UsageRecord.status) == "error", 1), else_=0)), 0)
    row = session.execute(
        sa_select(
            func.count(),
            is_error,
            func.sum(col(UsageRecord.cost)),
            func.count(col(UsageRecord.cost)),
            func.count(col(UsageRecord.latency_ms)),
            func.count(col(UsageRecord.ttft_ms)),
        ).where(*where)
    ).one()
    requests, errors, cost, num_priced, num_latency, num_ttft = row
    return ArmStats(
        requests=int(requests),
        errors=int(errors),
        p95_latency_ms=_p95(session, col(UsageRecord.latency_ms), where, int(num_latency)),
        p95_ttft_ms=_p95(session, col(UsageRecord.ttft_ms), where, int(num_ttft)),
        cost=Decimal(cost) if cost is not None else None,
        num_priced=int(num_priced),
    )


def _p95(session: Session, column: Any, where: list[ColumnElement[bool]], n: int) -> float | None:
    """Nearest-rank 95th percentile, computed by the database (no rows are loaded)."""
    if n == 0:
        return None
    rank = math.ceil(0.95 * n)
    query = select(column).where(*where, column.is_not(None)).order_by(column).offset(rank - 1).limit(1)
    value = session.execute(query).scalar()
    return float(value) if value is not None else None


@dataclass(slots=True)
class _Counters:
    requests: int = 0
    errors: int = 0
    escalations: int = 0

    @classmethod
    def of(cls, metrics: Any, key: str) -> _Counters:
        entry = metrics.get(key) if isinstance(metrics, dict) else None
        if not isinstance(entry, dict):
            return cls()
        return cls(*(_count(entry.get(name)) for name in ("requests", "errors", "escalations")))


def _count(value: Any) -> int:
    return int(value) if isinstance(value, int | float) and not isinstance(value, bool) and value >= 0 else 0


@dataclass(slots=True)
class _EdgeArm:
    requests: int = 0
    errors: int = 0
    escalations: int = 0
    p95_weighted: float = 0.0
    p95_weight: int = 0
    devices: set[str] = field(default_factory=set)

    def stats(self) -> ArmStats:
        p95 = self.p95_weighted / self.p95_weight if self.p95_weight else None
        return ArmStats(
            requests=self.requests,
            errors=self.errors,
            p95_latency_ms=p95,
            escalations=self.escalations,
            num_devices=len(self.devices),
        )


def _edge_window(
    session: Session,
    rollout: Rollout,
    since: datetime,
    now: datetime,
    excluded_devices: set[str],
    excluded_tenants: set[int],
) -> Window:
    """Per-version counters from devices' telemetry samples (cumulative per agent process, keyed
    ``model@version``), summed as increases over the window from the device's last sample before it,
    restarts counted from zero. p95 is each device's last reported p95 (its agent's recent requests),
    weighted by its requests in the window: an approximation. Attribution is by the version a device
    actually ran, so devices still converging count where they really were."""
    query = select(Device.id, Device.tenant_id, Device.labels)
    if rollout.tenant_id is not None:
        query = query.where(Device.tenant_id == rollout.tenant_id)
    selector = rollout.device_selector
    devices = [
        device_id
        for device_id, tenant_id, labels in session.exec(query)
        if device_id not in excluded_devices
        and tenant_id not in excluded_tenants
        and all((labels or {}).get(k) == v for k, v in selector.items())
    ]
    keys: dict[str, Arm] = {}
    for name in model_names(rollout.model):
        keys[f"{name}@{rollout.baseline_version}"] = BASELINE
        keys[f"{name}@{rollout.candidate_version}"] = CANDIDATE
    arms: dict[Arm, _EdgeArm] = {BASELINE: _EdgeArm(), CANDIDATE: _EdgeArm()}
    for start in range(0, len(devices), 500):
        chunk = devices[start : start + 500]
        events = select(DeviceEvent.device_id, DeviceEvent.occurred_at, DeviceEvent.payload).where(
            DeviceEvent.kind == "telemetry",
            col(DeviceEvent.device_id).in_(chunk),
            col(DeviceEvent.occurred_at) >= since - TELEMETRY_LOOKBACK,
            col(DeviceEvent.occurred_at) <= now,
        )
        if rollout.tenant_id is not None:
            events = events.where(DeviceEvent.tenant_id == rollout.tenant_id)
        by_device: dict[str, list[tuple[datetime, Any]]] = {}
        for device_id, at, payload in session.exec(events.order_by(col(DeviceEvent.occurred_at))):
            by_device.setdefault(device_id, []).append((_aware(at), (payload or {}).get("metrics")))
        for device_id, samples in by_device.items():
            _add_device(arms, keys, device_id, samples, since)
    return Window("edge", arms[BASELINE].stats(), arms[CANDIDATE].stats())


def _add_device(
    arms: dict[Arm, _EdgeArm],
    keys: Mapping[str, Arm],
    device_id: str,
    samples: list[tuple[datetime, Any]],
    since: datetime,
) -> None:
    before = [metrics for at, metrics in samples if at < since]
    inside = [metrics for at, metrics in samples if at >= since]
    if not before and inside:
        # No sample shortly before the window (telemetry dropped from a full outbox, or a long silence): the
        # first one inside is the reference, so counts from before the window never land in it.
        before, inside = inside[:1], inside[1:]
    for key, which in keys.items():
        prev = _Counters.of(before[-1], key) if before else _Counters()
        total = _Counters()
        last_p95: float | None = None
        for metrics in inside:
            cur = _Counters.of(metrics, key)
            if cur.requests < prev.requests:  # the agent restarted: its counters began again at zero
                prev = _Counters()
            total.requests += cur.requests - prev.requests
            total.errors += max(0, cur.errors - prev.errors)
            total.escalations += max(0, cur.escalations - prev.escalations)
            prev = cur
            p95 = metrics.get(key, {}).get("p95_ms") if isinstance(metrics, dict) else None
            if isinstance(p95, int | float) and not isinstance(p95, bool) and math.isfinite(p95):
                last_p95 = float(p95)
        if total.requests <= 0:
            continue
        acc = arms[which]
        acc.requests += total.requests
        acc.errors += total.errors
        acc.escalations += total.escalations
        acc.devices.add(device_id)
        if last_p95 is not None:
            acc.p95_weighted += last_p95 * total.requests
            acc.p95_weight += total.requests


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
            since = _aware(rollout.step_started_at or rollout.created_at)
            steps = rollout.steps
            nxt = steps[rollout.step_index + 1] if rollout.step_index + 1 < len(steps) else None
            decision = analyse(
                collect_windows(read, rollout, since, now),
                checks=rollout.checks,
                min_samples=rollout.min_samples,
                min_step_s=rollout.min_step_s,
                step_elapsed_s=max(0.0, (now - since).total_seconds()),
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
