"""Rollout metrics: per-arm aggregates over a window, from usage records (cloud traffic) and device telemetry
(fleets), computed by the database where it can (no usage rows are loaded)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any, Final

from sqlalchemy import and_, case, func, or_
from sqlalchemy import select as sa_select
from sqlalchemy.sql.elements import ColumnElement
from sqlmodel import Session, col, select

from controlplane.billing.ledger import cost_total
from controlplane.rollouts.analysis import ArmStats, ShadowStats, Window
from controlplane.rollouts.assignment import BASELINE, CANDIDATE, EXCLUDED, Arm, arm, fleet_subject
from controlplane.rollouts.plans import model_names
from controlplane.storage.tables import (
    Device,
    DeviceEvent,
    Rollout,
    RolloutPin,
    RolloutShadowSample,
    ShadowSample,
    Tenant,
    UsageRecord,
)
from shared.edge_protocol import version_number

TELEMETRY_LOOKBACK: Final = timedelta(minutes=15)  # how far back a device's last sample before a window is sought


def collect_windows(session: Session, rollout: Rollout, since: datetime, now: datetime) -> list[Window]:
    """Per-arm aggregates since ``since`` for each source the rollout's scope covers."""
    pins = list(session.exec(select(RolloutPin).where(RolloutPin.rollout_id == rollout.id)))
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
    if version_number(rollout.baseline_version) is None or version_number(rollout.candidate_version) is None:
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
            cost_total(),
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
        cost=cost if num_priced else None,
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
        events = _telemetry(rollout, chunk, since, now)
        by_device: dict[str, list[tuple[datetime, Any]]] = {}
        for device_id, at, payload in session.exec(events):
            by_device.setdefault(device_id, []).append((at, (payload or {}).get("metrics")))
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


# --- policy rollouts: devices as arms -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _PolicyDevice:
    id: str
    arm: Arm
    converged: bool  # the device reports running its arm's policy version


def policy_devices(session: Session, rollout: Rollout) -> list[_PolicyDevice]:
    """The devices a policy rollout judges: those its selector picks (excluded pins left out), each with its sticky
    arm at the rollout's weight and whether it already reports running that arm's version (``SyncRequest.policies``:
    a device that runs its own policy file reports ``override`` and never counts)."""
    pins = list(session.exec(select(RolloutPin).where(RolloutPin.rollout_id == rollout.id)))
    tenant_pins = {p.key: p.arm for p in pins if p.kind == "tenant"}
    tenant_names: dict[int, str] = {}
    if tenant_pins:
        rows = session.exec(select(Tenant.id, Tenant.name).where(col(Tenant.name).in_(tenant_pins)))
        tenant_names = {tid: name for tid, name in rows if tid is not None}
    device_pins = {p.key: p.arm for p in pins if p.kind == "device"}
    query = select(Device.id, Device.tenant_id, Device.labels, Device.policies).where(Device.status == "active")
    if rollout.tenant_id is not None:
        query = query.where(Device.tenant_id == rollout.tenant_id)
    names = model_names(rollout.model)
    out: list[_PolicyDevice] = []
    for device_id, tenant_id, labels, reported in session.exec(query):
        pin = device_pins.get(device_id) or tenant_pins.get(tenant_names.get(tenant_id, ""))
        if pin == EXCLUDED or not all((labels or {}).get(k) == v for k, v in rollout.device_selector.items()):
            continue
        subject = fleet_subject(device_id)
        which = arm(rollout.id or 0, subject, rollout.weight, {subject: pin} if pin else None)
        version = rollout.candidate_version if which == CANDIDATE else rollout.baseline_version
        running = next((str(v) for n, v in (reported or {}).items() if n in names), None)
        out.append(_PolicyDevice(device_id, which, running == version))
    return out


POLICIES_KEY: Final = "reported_policies"  # on a stored telemetry sample: the policies its sync reported in use


def _telemetry(rollout: Rollout, devices: list[str], since: datetime, now: datetime) -> Any:
    """The telemetry samples of ``devices`` (of the rollout's tenant, if it has one) that a window from
    ``since`` to ``now`` reads: from a lookback before it, for each device's reference sample."""
    events = select(DeviceEvent.device_id, DeviceEvent.occurred_at, DeviceEvent.payload).where(
        DeviceEvent.kind == "telemetry",
        col(DeviceEvent.device_id).in_(devices),
        col(DeviceEvent.occurred_at) >= since - TELEMETRY_LOOKBACK,
        col(DeviceEvent.occurred_at) <= now,
    )
    if rollout.tenant_id is not None:
        events = events.where(DeviceEvent.tenant_id == rollout.tenant_id)
    return events.order_by(col(DeviceEvent.occurred_at))


def policy_window(session: Session, rollout: Rollout, since: datetime, now: datetime) -> Window:
    """Per-arm aggregates of a policy rollout over the devices its selector picks.

    Requests, errors, escalations and p95 come from the devices' telemetry for the policy's model (every model
    version), as increases between samples (restarts counted from zero, as in :func:`_edge_window`). Each increase
    counts for the arm whose version the device reported using at the sync that carried the sample (the cloud
    stores it with the sample: :data:`POLICIES_KEY`; the agent takes a sample just before each sync and switches
    policy at a sync's answer, so the requests between two samples were all served under the later one's
    policy). A sample stored without it (an older cloud) counts for the device's assigned arm once the device
    reports running that arm's version. An increase under a version that is neither arm's (``override``: the
    device's own file) counts for neither.

    Cost comes from the ledger: the edge records of the model and the escalated (cloud) records, in the window,
    of the devices that now report running their arm's version, over the number of those records."""
    devices = policy_devices(session, rollout)
    arms: dict[Arm, _EdgeArm] = {BASELINE: _EdgeArm(), CANDIDATE: _EdgeArm()}
    members: dict[Arm, list[str]] = {BASELINE: [], CANDIDATE: []}
    fallback: dict[str, Arm | None] = {}
    for d in devices:
        fallback[d.id] = d.arm if d.converged else None
        if d.converged:
            members[d.arm].append(d.id)
    names = model_names(rollout.model)
    versions: dict[str, Arm] = {rollout.baseline_version: BASELINE, rollout.candidate_version: CANDIDATE}
    ids = [d.id for d in devices]
    for start in range(0, len(ids), 500):
        chunk = ids[start : start + 500]
        events = _telemetry(rollout, chunk, since, now)
        by_device: dict[str, list[tuple[datetime, Any, Arm | None]]] = {}
        for device_id, at, payload in session.exec(events):
            payload = payload or {}
            reported = payload.get(POLICIES_KEY)
            if isinstance(reported, dict):
                used = next((str(v) for n, v in reported.items() if n in names), None)
                which = versions.get(used) if used is not None else None
            else:
                which = fallback.get(device_id)
            by_device.setdefault(device_id, []).append((at, payload.get("metrics"), which))
        for device_id, samples in by_device.items():
            _add_policy_device(arms, names, device_id, samples, since)
    stats = {which: _with_cost(session, arms[which].stats(), members[which], names, since, now) for which in arms}
    sides: tuple[tuple[Arm, str], ...] = ((BASELINE, rollout.baseline_version), (CANDIDATE, rollout.candidate_version))
    for side, version in sides:
        shadow, disagreed = _shadow_counts(session, rollout, version, members[side], names, since, now)
        stats[side] = replace(stats[side], shadow_samples=shadow, shadow_disagreements=disagreed)
    return Window("policy", stats[BASELINE], stats[CANDIDATE])


def _shadow_counts(
    session: Session,
    rollout: Rollout,
    version: str,
    devices: list[str],
    names: tuple[str, ...],
    since: datetime,
    now: datetime,
) -> tuple[int, int]:
    """The live quality monitor's shadow samples in the window from an arm's devices under the arm's policy
    version: how many, and how many of them the cloud answered differently."""
    if not devices or not version.isdigit():
        return 0, 0
    samples = disagreements = 0
    for start in range(0, len(devices), 500):
        where: list[ColumnElement[bool]] = [
            col(ShadowSample.device_id).in_(devices[start : start + 500]),
            col(ShadowSample.model).in_(names),
            col(ShadowSample.policy_version) == int(version),
            col(ShadowSample.created_at) >= since,
            col(ShadowSample.created_at) <= now,
        ]
        if rollout.tenant_id is not None:
            where.append(col(ShadowSample.tenant_id) == rollout.tenant_id)
        count, agreed = session.execute(
            sa_select(func.count(), func.sum(case((col(ShadowSample.agrees), 1), else_=0))).where(*where)
        ).one()
        samples += int(count)
        disagreements += int(count) - int(agreed or 0)
    return samples, disagreements


def _add_policy_device(
    arms: dict[Arm, _EdgeArm],
    names: tuple[str, ...],
    device_id: str,
    samples: list[tuple[datetime, Any, Arm | None]],
    since: datetime,
) -> None:
    """Add one device's increases inside the window, each to the arm of the sample that ends it."""
    before = [s for s in samples if s[0] < since]
    inside = [s for s in samples if s[0] >= since]
    if not before and inside:  # no reference before the window: the first sample inside is the reference
        before, inside = inside[:1], inside[1:]
    keys = {
        key
        for _, metrics, _ in samples
        if isinstance(metrics, dict)
        for key in metrics
        if isinstance(key, str) and key.partition("@")[0] in names
    }
    for key in keys:
        prev = _Counters.of(before[-1][1], key) if before else _Counters()
        for _, metrics, which in inside:
            cur = _Counters.of(metrics, key)
            if cur.requests < prev.requests:  # the agent restarted: its counters began again at zero
                prev = _Counters()
            requests = cur.requests - prev.requests
            if which is not None and requests > 0:
                acc = arms[which]
                acc.requests += requests
                acc.errors += max(0, cur.errors - prev.errors)
                acc.escalations += max(0, cur.escalations - prev.escalations)
                acc.devices.add(device_id)
                p95 = metrics.get(key, {}).get("p95_ms") if isinstance(metrics, dict) else None
                if isinstance(p95, int | float) and not isinstance(p95, bool) and math.isfinite(p95):
                    acc.p95_weighted += float(p95) * requests
                    acc.p95_weight += requests
            prev = cur


def _with_cost(
    session: Session, stats: ArmStats, devices: list[str], names: tuple[str, ...], since: datetime, now: datetime
) -> ArmStats:
    if not devices:
        return stats
    cost = Decimal(0)
    priced = 0
    for start in range(0, len(devices), 500):
        chunk = devices[start : start + 500]
        amount, count = session.execute(
            sa_select(cost_total(), func.count(col(UsageRecord.cost))).where(
                col(UsageRecord.device_id).in_(chunk),
                col(UsageRecord.occurred_at) >= since,
                col(UsageRecord.occurred_at) <= now,
                or_(
                    and_(col(UsageRecord.tier) == "edge", col(UsageRecord.model).in_(names)),
                    and_(col(UsageRecord.tier) == "cloud", col(UsageRecord.escalation_reason).is_not(None)),
                ),
            )
        ).one()
        cost += amount
        priced += int(count)
    return ArmStats(
        requests=stats.requests,
        errors=stats.errors,
        p95_latency_ms=stats.p95_latency_ms,
        escalations=stats.escalations,
        cost=cost if priced else None,
        num_priced=priced,
        num_devices=stats.num_devices,
    )


# --- billing: what a candidate served ---------------------------------------------------------------------------


def candidate_usage(session: Session, rollout: Rollout, until: datetime) -> dict[str, Any]:
    """What the candidate served from the rollout's creation to ``until``: its usage records (stamped
    ``candidate``, cloud and edge), per tenant, with the cost they were rated at.

    Usage is billed as served (see docs/registry.md, "Billing a rolled-back candidate"): a rollback never
    re-rates or voids records. This summary goes on the ``rolled_back`` / ``aborted`` event so an operator can
    credit what the failed candidate cost each tenant.
    """
    where: list[ColumnElement[bool]] = [
        col(UsageRecord.model).in_(model_names(rollout.model)),
        col(UsageRecord.rollout_arm) == CANDIDATE,
        col(UsageRecord.occurred_at) >= rollout.created_at,
        col(UsageRecord.occurred_at) <= until,
    ]
    candidate = version_number(rollout.candidate_version)
    if candidate is not None:  # cloud versions are numbers; edge records carry the artifact's name
        where.append(col(UsageRecord.model_version) == candidate)
    if rollout.tenant_id is not None:
        where.append(col(UsageRecord.tenant_id) == rollout.tenant_id)
    rows = session.execute(
        sa_select(
            col(UsageRecord.tenant_id),
            func.count(),
            func.coalesce(func.sum(col(UsageRecord.prompt_tokens)), 0),
            func.coalesce(func.sum(col(UsageRecord.completion_tokens)), 0),
            cost_total(),
            func.count(col(UsageRecord.cost)),
        )
        .where(*where)
        .group_by(col(UsageRecord.tenant_id))
        .order_by(col(UsageRecord.tenant_id))
    ).all()
    by_tenant = []
    total_cost = Decimal(0)
    for tenant_id, requests, prompt, completion, amount, num_priced in rows:
        total_cost += amount
        by_tenant.append(
            {
                "tenant_id": tenant_id,
                "requests": int(requests),
                "prompt_tokens": int(prompt),
                "completion_tokens": int(completion),
                "cost": str(amount),
                "unpriced_requests": int(requests) - int(num_priced),
            }
        )
    return {
        "rule": "billed as served",
        "requests": sum(t["requests"] for t in by_tenant),
        "cost": str(total_cost),
        "by_tenant": by_tenant,
    }


def shadow_stats(session: Session, rollout_id: int, since: datetime, now: datetime) -> ShadowStats:
    """The shadow step's mirrored samples of a rollout recorded in ``[since, now]``: count and mean agreement."""
    count, mean = session.execute(
        sa_select(func.count(), func.avg(col(RolloutShadowSample.agreement))).where(
            col(RolloutShadowSample.rollout_id) == rollout_id,
            col(RolloutShadowSample.at) >= since,
            col(RolloutShadowSample.at) <= now,
        )
    ).one()
    return ShadowStats(samples=int(count), mean_agreement=float(mean) if mean is not None else None)
