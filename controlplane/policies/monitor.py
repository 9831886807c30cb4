"""The live quality monitor: agreement between the edge's answers and the cloud's, per model, policy version and
device group, checked against what the policy's calibration promised.

A share of edge-answered requests is answered again by the cloud in the background (``cloud.edge.quality_monitor``);
each input becomes a ``shadow_sample`` row: whether the cloud agreed, and the edge's confidence. After each batch
the monitor checks the group it belongs to:

- *promised*: the agreement with the cloud that the calibration showed on the requests it kept on the edge (the
  top ``edge_share`` of the validation set by confidence, from the set the control plane keeps; without it, the
  bound the quality loss implies: ``1 - max_quality_loss / edge_share``);
- *observed*: the samples of that policy version and group; the alert fires when the one-sided Wilson upper bound
  (``Z_ALERT``, 99 %) of their agreement lies below the promise minus ``TOLERANCE``, after at least
  ``MIN_SAMPLES``: the agreement is then below the promise with high confidence, not by chance.

An alert is one ``quality_alert`` row per model, version and group, with an audit entry; it carries a proposed
policy: the same policy with the lowest threshold at which the shadow samples' agreement meets the promise. An
admin accepts it (it becomes the model's next signed version, which the fleet receives at its next sync) or
dismisses it.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from sqlalchemy import Integer, cast, func
from sqlalchemy import select as sql_select
from sqlmodel import Session, col, select

from controlplane.billing.ledger import NewUsage, ingest_usage
from controlplane.billing.pricing import PriceLookup
from controlplane.policies import service
from controlplane.storage.audit import audit
from controlplane.storage.tables import EscalationPolicy, QualityAlert, ShadowSample
from shared.errors import ConfigurationError, ConflictError, NotFoundError
from shared.escalation import HIDDEN_PROBE, ROUTER, EdgePolicy

GROUP_LABELS = ("group", "ring")  # the device label that names its group, first found wins
MIN_SAMPLES = 30
Z_ALERT = 2.326  # one-sided 99 %
TOLERANCE = 0.01  # the validation set's own estimate is not exact either
MIN_PROPOSAL_SAMPLES = 20
OPEN, ACCEPTED, DISMISSED = "open", "accepted", "dismissed"


def device_group(labels: dict[str, str] | None) -> str:
    """The group a device's samples count in: its ``group`` label, else its ``ring``, else ``''`` (none)."""
    for name in GROUP_LABELS:
        value = (labels or {}).get(name)
        if value:
            return value[:64]
    return ""


def wilson_upper(agreements: int, samples: int, z: float = Z_ALERT) -> float:
    """One-sided upper confidence bound of a binomial proportion (Wilson score interval)."""
    if samples <= 0:
        return 1.0
    p = agreements / samples
    denom = 1.0 + z * z / samples
    centre = p + z * z / (2 * samples)
    spread = z * math.sqrt(p * (1 - p) / samples + z * z / (4 * samples * samples))
    return min(1.0, (centre + spread) / denom)


def wilson_lower(agreements: int, samples: int, z: float = Z_ALERT) -> float:
    if samples <= 0:
        return 0.0
    p = agreements / samples
    denom = 1.0 + z * z / samples
    centre = p + z * z / (2 * samples)
    spread = z * math.sqrt(p * (1 - p) / samples + z * z / (4 * samples * samples))
    return max(0.0, (centre - spread) / denom)


def is_below_promise(agreements: int, samples: int, promised: float) -> bool:
    """Whether ``agreements`` of ``samples`` say, with 99 % confidence, that agreement is below ``promised``."""
    return samples >= MIN_SAMPLES and wilson_upper(agreements, samples) < promised - TOLERANCE


@lru_cache(maxsize=64)
def _validation_agreement(path: str, mtime_ns: int, model: str, policy_json: str, edge_share: float) -> float | None:
    import json

    from shared.calibration import read_validation, router_inputs

    try:
        data = read_validation(Path(path), model)
    except ConfigurationError:
        return None
    policy = EdgePolicy.from_json(json.loads(policy_json))
    if policy.signal == ROUTER and policy.router is not None:
        confidence = policy.router.confidences(router_inputs(data))
    elif (
        policy.signal == HIDDEN_PROBE
        and policy.probe is not None
        and data.probe_inputs is not None
        and data.probe_input == policy.probe.input
        and data.probe_inputs.shape[1] == len(policy.probe.weights)
    ):
        confidence = policy.probe.confidences(data.probe_inputs)
    elif policy.signal in data.signals:
        confidence = data.signals[policy.signal]
    else:
        return None
    return calibrated_agreement(confidence, data.agrees, edge_share)


def calibrated_agreement(confidence: np.ndarray, agrees: np.ndarray, edge_share: float) -> float | None:
    """The agreement with the cloud on the ``edge_share`` of items with the highest confidence: what a policy
    calibrated to that share promises on the requests it keeps on the edge (None: it keeps none)."""
    keep = round(edge_share * len(agrees))
    if keep <= 0:
        return None
    order = np.argsort(-np.asarray(confidence, dtype=np.float64), kind="stable")[:keep]
    return float(np.mean(np.asarray(agrees)[order]))


def promised_agreement(row: EscalationPolicy, data_dir: Path | None = None) -> float | None:
    """The agreement with the cloud that ``row``'s calibration promised on the requests it keeps on the edge;
    None when it keeps none (nothing to monitor)."""
    import json

    calibration = row.policy.get("calibration") or {}
    stated = calibration.get("edge_agreement")
    if isinstance(stated, int | float):
        return float(stated)
    share = calibration.get("edge_share")
    if not isinstance(share, int | float) or share <= 0:
        return None
    path = service.validation_path(row.model, data_dir)
    if path.is_file():
        policy_json = json.dumps(row.policy, sort_keys=True)
        found = _validation_agreement(str(path), path.stat().st_mtime_ns, row.model, policy_json, float(share))
        if found is not None:
            return found
    return max(0.0, 1.0 - float(row.max_quality_loss) / float(share))


@dataclass(frozen=True, slots=True)
class Agreement:
    """The shadow samples of one model, policy version and device group."""

    model: str
    policy_version: int
    device_group: str
    num_samples: int
    num_agreements: int
    promised: float | None
    token_agreement: float | None = None  # LM samples: the mean share of the edge's tokens the cloud chose too

    @property
    def agreement(self) -> float | None:
        return self.num_agreements / self.num_samples if self.num_samples else None

    @property
    def upper_bound(self) -> float:
        return wilson_upper(self.num_agreements, self.num_samples)

    @property
    def min_samples(self) -> int:
        return MIN_SAMPLES

    @property
    def verdict(self) -> str:
        """``below`` (an alert's condition: below the promise with 99 % confidence), ``consistent`` (not shown to
        be below), ``too-few`` (under ``MIN_SAMPLES``: no verdict yet, whatever the share) or ``no-promise``."""
        if self.promised is None:
            return "no-promise"
        if self.num_samples < MIN_SAMPLES:
            return "too-few"
        return "below" if is_below_promise(self.num_agreements, self.num_samples, self.promised) else "consistent"


def agreement_table(session: Session, model: str | None = None) -> list[Agreement]:
    """Every group's counts (newest policy versions first), with the promise of its version."""
    agrees = func.sum(cast(col(ShadowSample.agrees), Integer))
    tokens = func.avg(col(ShadowSample.token_agreement))  # AVG skips the classifier rows' NULLs
    query = sql_select(
        col(ShadowSample.model),
        col(ShadowSample.policy_version),
        col(ShadowSample.device_group),
        func.count(),
        agrees,
        tokens,
    ).group_by(col(ShadowSample.model), col(ShadowSample.policy_version), col(ShadowSample.device_group))
    if model is not None:
        query = query.where(col(ShadowSample.model) == model)
    out = []
    for name, version, group, n, k, share in session.execute(query).all():
        row = _policy_row(session, name, version)
        promised = promised_agreement(row) if row else None
        token_share = None if share is None else float(share)
        out.append(Agreement(name, version, group, int(n), int(k or 0), promised, token_share))
    return sorted(out, key=lambda a: (a.model, -a.policy_version, a.device_group))


def _policy_row(session: Session, model: str, version: int) -> EscalationPolicy | None:
    query = select(EscalationPolicy).where(EscalationPolicy.model == model, EscalationPolicy.version == version)
    return session.exec(query).first()


def _counts(session: Session, model: str, version: int, group: str) -> tuple[int, int]:
    query = sql_select(func.count(), func.sum(cast(col(ShadowSample.agrees), Integer))).where(
        col(ShadowSample.model) == model,
        col(ShadowSample.policy_version) == version,
        col(ShadowSample.device_group) == group,
    )
    n, k = session.execute(query).one()
    return int(n), int(k or 0)


def _samples(session: Session, model: str, version: int, group: str) -> tuple[np.ndarray, np.ndarray]:
    query = select(ShadowSample.confidence, ShadowSample.agrees).where(
        ShadowSample.model == model, ShadowSample.policy_version == version, ShadowSample.device_group == group
    )
    rows = session.exec(query).all()
    return np.array([r[0] for r in rows], dtype=np.float64), np.array([bool(r[1]) for r in rows])


def propose_threshold(confidence: np.ndarray, agrees: np.ndarray, promised: float) -> float:
    """The lowest threshold at which the samples answered on the edge (confidence at or above it) agree with the
    cloud at least as often as promised, over at least ``MIN_PROPOSAL_SAMPLES``; with none, one above every
    sampled confidence (everything that was sampled goes up)."""
    order = np.argsort(-confidence, kind="stable")
    conf, good = confidence[order], agrees[order].astype(np.float64)
    running = np.cumsum(good) / np.arange(1, len(good) + 1)
    best: float | None = None
    for i in range(len(conf)):
        if i + 1 < MIN_PROPOSAL_SAMPLES or (i + 1 < len(conf) and conf[i + 1] == conf[i]):
            continue  # a threshold cuts between distinct confidences only
        if running[i] >= promised - 1e-12:
            best = float(conf[i])
    if best is not None:
        return best
    top = float(conf[0]) if len(conf) else 0.0
    return float(np.nextafter(top, np.inf))


def check_group(
    session: Session, model: str, version: int, group: str, now: datetime | None = None
) -> QualityAlert | None:
    """Raise an alert for the group when its agreement is below the promise (once per model, version and group);
    the alert raised now, else None. The caller commits."""
    existing = session.exec(
        select(QualityAlert).where(
            QualityAlert.model == model, QualityAlert.policy_version == version, QualityAlert.device_group == group
        )
    ).first()
    if existing is not None:
        return None
    row = _policy_row(session, model, version)
    if row is None:
        return None
    promised = promised_agreement(row)
    if promised is None:
        return None
    n, k = _counts(session, model, version, group)
    if not is_below_promise(k, n, promised):
        return None
    confidence, agrees = _samples(session, model, version, group)  # read whole only to propose a threshold
    n, k = len(agrees), int(agrees.sum())
    threshold = propose_threshold(confidence, agrees, promised)
    policy = EdgePolicy.from_json(row.policy)
    kept = confidence >= threshold
    proposed = dataclasses.replace(
        policy,
        threshold=threshold,
        calibration={
            **policy.calibration,
            "recalibrated_from_shadow": {
                "from_version": version,
                "device_group": group,
                "num_samples": n,
                "agreement": k / n,
                "promised": promised,
                "sampled_edge_share": float(kept.mean()),
                "agreement_at_threshold": float(agrees[kept].mean()) if kept.any() else None,
            },
        },
    )
    alert = QualityAlert(
        model=model,
        policy_version=version,
        device_group=group,
        num_samples=n,
        num_agreements=k,
        upper_bound=wilson_upper(k, n),
        promised=promised,
        proposed_threshold=threshold,
        proposed_policy=proposed.to_json(),
        created_at=now or datetime.now(UTC),
    )
    session.add(alert)
    session.flush()
    audit(
        session,
        "quality-monitor",
        "quality_alert.raise",
        f"escalation_policy/{model}",
        None,
        {
            "alert": alert.id,
            "version": version,
            "device_group": group,
            "samples": n,
            "agreement": round(k / n, 4),
            "upper_bound": round(alert.upper_bound, 4),
            "promised": round(promised, 4),
            "proposed_threshold": threshold,
        },
    )
    return alert


@dataclass(frozen=True, slots=True)
class Sample:
    """One input of a shadow batch: the edge's confidence and whether the cloud agreed (for an LM answer, also
    the share of its tokens the cloud chose too)."""

    confidence: float
    agrees: bool
    token_agreement: float | None = None


def record_batch(
    session: Session,
    usage: NewUsage,
    *,
    model: str,
    policy_version: int,
    group: str,
    samples: list[Sample],
    prices: PriceLookup | None = None,
) -> tuple[bool, QualityAlert | None]:
    """Bill a shadow batch (``usage``, tier ``shadow``) and store its samples in one transaction, exactly once:
    a batch whose usage id is already stored (a retry) changes nothing. Returns ``(is_new, alert raised)``."""
    result = ingest_usage(session, [usage], prices)
    if usage.id not in result.accepted_ids:
        return False, None
    assert usage.device_id is not None
    for s in samples:
        session.add(
            ShadowSample(
                usage_id=usage.id,
                tenant_id=usage.tenant_id,
                device_id=usage.device_id,
                model=model,
                policy_version=policy_version,
                device_group=group,
                confidence=float(s.confidence),
                agrees=bool(s.agrees),
                token_agreement=None if s.token_agreement is None else float(s.token_agreement),
            )
        )
    session.flush()
    return True, check_group(session, model, policy_version, group)


def alerts(session: Session, model: str | None = None, *, only_open: bool = False) -> list[QualityAlert]:
    query = select(QualityAlert)
    if model is not None:
        query = query.where(QualityAlert.model == model)
    if only_open:
        query = query.where(QualityAlert.status == OPEN)
    return list(session.exec(query.order_by(col(QualityAlert.id).desc())))


def _open_alert(session: Session, alert_id: int) -> QualityAlert:
    alert = session.get(QualityAlert, alert_id)
    if alert is None:
        raise NotFoundError(f"no quality alert {alert_id}", param="alert")
    if alert.status != OPEN:
        raise ConflictError(f"quality alert {alert_id} is already {alert.status}")
    return alert


def accept(session: Session, alert_id: int, *, actor: str, key: Ed25519PrivateKey) -> EscalationPolicy:
    """Make the alert's proposal the model's next signed version (same target and calibration data)."""
    alert = _open_alert(session, alert_id)
    base = _policy_row(session, alert.model, alert.policy_version)
    if base is None or alert.proposed_policy is None:
        raise ConflictError(f"quality alert {alert_id} has no proposal to accept")
    row = service._store(
        session,
        EdgePolicy.from_json(alert.proposed_policy),
        max_quality_loss=base.max_quality_loss,
        data_sha256=base.data_sha256,
        data_items=base.data_items,
        target=list(base.target),
        derived_from=base.version,
        actor=actor,
        key=key,
        action="escalation_policy.recalibrate",
    )
    alert.status, alert.accepted_version = ACCEPTED, row.version
    alert.resolved_by, alert.resolved_at = actor[:128], datetime.now(UTC)
    session.add(alert)
    target = f"escalation_policy/{alert.model}"
    audit(session, actor, "quality_alert.accept", target, {"alert": alert.id}, {"version": row.version})
    return row


def dismiss(session: Session, alert_id: int, *, actor: str) -> QualityAlert:
    alert = _open_alert(session, alert_id)
    alert.status, alert.resolved_by, alert.resolved_at = DISMISSED, actor[:128], datetime.now(UTC)
    session.add(alert)
    audit(session, actor, "quality_alert.dismiss", f"escalation_policy/{alert.model}", {"alert": alert.id}, None)
    return alert


def alert_json(alert: QualityAlert) -> dict[str, Any]:
    return {
        "id": alert.id,
        "model": alert.model,
        "policy_version": alert.policy_version,
        "device_group": alert.device_group,
        "num_samples": alert.num_samples,
        "agreement": alert.num_agreements / alert.num_samples if alert.num_samples else None,
        "upper_bound": alert.upper_bound,
        "promised": alert.promised,
        "status": alert.status,
        "proposed_threshold": alert.proposed_threshold,
        "accepted_version": alert.accepted_version,
        "created_at": alert.created_at.isoformat(),
    }
