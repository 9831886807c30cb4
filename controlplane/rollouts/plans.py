"""Who gets which version while a rollout governs a model: :class:`RolloutPlan` snapshots, read by the edge
gateway (:func:`edge_version`, per device), the cloud (:func:`resolve_cloud_arm`, per request) and usage
ingestion (:func:`usage_arm`, the arm stamped on a usage record)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Final

from sqlalchemy import func
from sqlmodel import Session, col, select

from controlplane.rollouts.analysis import Source
from controlplane.rollouts.assignment import BASELINE, CANDIDATE, EXCLUDED, Arm, arm, cloud_subject, fleet_subject
from controlplane.storage.tables import Rollout, RolloutPin, Tenant

MODEL_PREFIX: Final = "tierline/"


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
    step_index: int = 0
    shadow_sample: float = 0.0  # percent of baseline requests mirrored to the candidate at the shadow step

    @property
    def shadowing(self) -> bool:
        """At the shadow step: running step 0 at weight 0 with a sample to mirror (users get the baseline)."""
        return self.shadow_sample > 0 and self.step_index == 0 and self.status == "running" and self.weight == 0

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


def load_plans(session: Session, target: Source, *, kind: str = "model") -> list[RolloutPlan]:
    """The newest rollout of ``kind`` per model (and tenant) whose scope covers ``target``, with its pins.

    The newest governs, whatever its state: pending or active rollouts hold the model, a finished one
    decides the outcome (the edge lets a later publish override a finished rollout, see edge_releases).
    """
    newest = (
        select(func.max(Rollout.id))
        .where(col(Rollout.scope).in_((target, "both")), col(Rollout.kind) == kind)
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
            finished_at=r.finished_at,
            step_index=r.step_index,
            shadow_sample=r.shadow_sample,
        )
        for r in rollouts
    ]


def load_policy_plans(session: Session) -> list[RolloutPlan]:
    """The newest policy rollout per edge model (and tenant): which escalation policy version each device runs."""
    return load_plans(session, "edge", kind="policy")


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
