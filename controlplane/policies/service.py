"""Escalation policies as versioned, signed registry objects, one series of versions per edge model.

A version holds the signal, the threshold, the calibration curve it was read from, the validation set's digest
and size, the quality-loss bound, its device target and who made it. Versions are immutable and signed with the
registry's signing key (``controlplane.registry.artifacts.platform_signing_key``); the cloud hands each device,
at every sync, the newest version of each model whose target matches it (``desired_for``), and the agent
verifies the signature before using it.

Two ways to make a version:
- ``calibrate``: run the calibration (``shared.calibration``) on the model's validation set, kept by the
  control plane under ``$TIERLINE_DATA_DIR/validation/`` (a set given with ``--data`` is stored there first);
  ``calibrate_from_prompts`` makes that set first, for any edge/cloud pair of registry models, from a team's own
  prompts (``controlplane.policies.prompt_validation``);
- ``move_operating_point``: a new max quality loss read off the latest version's stored curve, no recalibration.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from sqlmodel import Session, col, select

from controlplane.policies.prompt_validation import (
    DEFAULT_MAX_NEW_TOKENS,
    pair_rows,
    read_prompts,
    write_rows,
)
from controlplane.rollouts.plans import edge_version, load_policy_plans, plans_for
from controlplane.storage.audit import audit
from controlplane.storage.tables import Device, EscalationPolicy
from controlplane.storage.types import as_utc
from shared.edge_protocol import DesiredPolicy
from shared.errors import ConfigurationError, ConflictError, NotFoundError, ValidationError
from shared.escalation import ROUTER, EdgePolicy
from shared.policy_signing import sign_policy
from shared.settings import CoreSettings
from shared.targeting import check_target, describe, matches

FINAL = ("promoted", "rolled_back", "aborted")  # a finished rollout (controlplane.rollouts.service.FINAL)
VALIDATION_DIR = "validation"
QUALITY_EPS = 1e-12
MAX_NEW_TOKENS_LIMIT = 512


def validation_path(model: str, data_dir: Path | None = None) -> Path:
    """Where the control plane keeps ``model``'s validation set (JSON Lines, ``tierline edge calibrate --data``)."""
    return (data_dir or CoreSettings().data_dir) / VALIDATION_DIR / f"{model.replace('/', '__')}.jsonl"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def check_loss(value: float) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool) or not 0.0 <= float(value) <= 1.0:
        raise ValidationError("max_quality_loss: a number from 0 to 1 (0.01 = one point)", param="max_quality_loss")
    return float(value)


def resolve_model(session: Session, model: str) -> str:
    """A stored model id from its full id or last part (``digits-small``); the name as given when none is stored."""
    names = set(session.exec(select(EscalationPolicy.model).distinct()).all())
    if model in names:
        return model
    found = sorted(n for n in names if n.rsplit("/", 1)[-1] == model)
    if len(found) > 1:
        raise ValidationError(f"model {model!r} matches {', '.join(found)}; give the full id", param="model")
    return found[0] if found else model


def versions_of(session: Session, model: str) -> list[EscalationPolicy]:
    """Newest first."""
    query = select(EscalationPolicy).where(EscalationPolicy.model == model)
    return list(session.exec(query.order_by(col(EscalationPolicy.version).desc())))


def get_version(session: Session, model: str, version: int | None = None) -> EscalationPolicy:
    """A model's policy version (the newest when ``version`` is None)."""
    model = resolve_model(session, model)
    rows = versions_of(session, model)
    if version is not None:
        rows = [r for r in rows if r.version == version]
    if not rows:
        what = f"version {version} of " if version is not None else ""
        raise NotFoundError(f"no escalation policy {what}{model!r}", param="model")
    return rows[0]


def models(session: Session) -> list[str]:
    return sorted(set(session.exec(select(EscalationPolicy.model).distinct()).all()))


def _store(
    session: Session,
    policy: EdgePolicy,
    *,
    max_quality_loss: float,
    data_sha256: str,
    data_items: int,
    target: list[dict[str, str]],
    derived_from: int | None,
    actor: str,
    key: Ed25519PrivateKey,
    action: str,
) -> EscalationPolicy:
    previous = versions_of(session, policy.model)
    version = (previous[0].version + 1) if previous else 1
    body = policy.to_json()
    key_id, signature = sign_policy(key, policy.model, version, target, body)
    row = EscalationPolicy(
        model=policy.model,
        version=version,
        signal=policy.signal,
        threshold=policy.threshold,
        max_quality_loss=max_quality_loss,
        policy=body,
        data_sha256=data_sha256,
        data_items=data_items,
        target=target,
        derived_from=derived_from,
        signature=signature,
        key_id=key_id,
        created_by=actor[:128],
    )
    session.add(row)
    session.flush()
    after = {
        "version": version,
        "signal": policy.signal,
        "threshold": policy.threshold,
        "max_quality_loss": max_quality_loss,
        "target": describe(target),
        "data_sha256": data_sha256,
    }
    before = {"version": previous[0].version, "threshold": previous[0].threshold} if previous else None
    audit(session, actor, action, f"escalation_policy/{policy.model}", before, after)
    return row


def store_validation(model: str, data: Path) -> Path:
    """Keep a validation set for ``model`` in the control plane (the file as given, copied atomically)."""
    dest = validation_path(model)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_suffix(".tmp")
    shutil.copyfile(data, tmp)
    tmp.replace(dest)
    return dest


def calibrate(
    session: Session,
    model: str,
    *,
    max_quality_loss: float,
    actor: str,
    key: Ed25519PrivateKey,
    data: Path | None = None,
    target: Iterable[Any] | None = None,
) -> EscalationPolicy:
    """Calibrate ``model`` on its validation set (``data`` is stored first as the model's set) and store the
    result as a new signed version. Mode and limits an earlier version set are kept; the target is the given one,
    else the latest version's."""
    from shared.calibration import calibrate as run_calibration
    from shared.calibration import read_validation, router_inputs

    loss = check_loss(max_quality_loss)
    model = resolve_model(session, model)
    path = data if data is not None else validation_path(model)
    if data is None and not path.is_file():
        raise NotFoundError(
            f"no validation data for {model!r} in the control plane; give it once with --data FILE "
            "(tierline bench cascade --export-validation FILE writes one)",
            param="model",
        )
    try:
        values = read_validation(path, model)  # a bad file is refused before it is kept
    except ConfigurationError as exc:
        raise ValidationError(exc.message, param="data") from None
    if data is not None:
        path = store_validation(values.model, data)
    policy, _ = run_calibration(values, loss)
    confidence = (
        policy.router.confidences(router_inputs(values))
        if policy.signal == ROUTER and policy.router is not None
        else values.signals[policy.signal]
    )
    policy.calibration["max_confidence"] = float(np.max(confidence))
    previous = versions_of(session, policy.model)
    if previous:
        old = EdgePolicy.from_json(previous[0].policy)
        policy = dataclasses.replace(
            policy,
            mode=old.mode,
            max_prompt_tokens=old.max_prompt_tokens,
            max_new_tokens=old.max_new_tokens,
            stream_window=old.stream_window,
        )
    terms = check_target(list(target)) if target is not None else (previous[0].target if previous else [])
    return _store(
        session,
        policy,
        max_quality_loss=loss,
        data_sha256=_sha256(path),
        data_items=len(values),
        target=terms,
        derived_from=None,
        actor=actor,
        key=key,
        action="escalation_policy.calibrate",
    )


def calibrate_from_prompts(
    session: Session,
    model: str,
    *,
    prompts: Path,
    max_quality_loss: float,
    actor: str,
    key: Ed25519PrivateKey,
    cloud_model: str | None = None,
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    target: Iterable[Any] | None = None,
) -> EscalationPolicy:
    """Calibrate registry edge model ``model`` on a team's own prompts: both tiers (``cloud_model``, else the
    model's pairing) answer them here, their answers graded against each prompt's reference (or the cloud's
    answer), and the rows become the model's validation set; then as ``calibrate``."""
    from shared.calibration import MIN_ITEMS

    loss = check_loss(max_quality_loss)
    if not 1 <= max_new_tokens <= MAX_NEW_TOKENS_LIMIT:
        raise ValidationError(f"max_new_tokens: from 1 to {MAX_NEW_TOKENS_LIMIT}", param="max_new_tokens")
    items = read_prompts(prompts)
    if len(items) < MIN_ITEMS:
        raise ValidationError(f"{prompts}: only {len(items)} prompts; calibration needs {MIN_ITEMS}", param="data")
    rows = pair_rows(session, model, cloud_model, items, max_new_tokens)
    staged = write_rows(rows, validation_path(model).with_suffix(".rows.tmp"))
    try:
        return calibrate(session, model, max_quality_loss=loss, actor=actor, key=key, data=staged, target=target)
    finally:
        staged.unlink(missing_ok=True)


def operating_point(calibration: dict[str, Any], max_quality_loss: float) -> tuple[float, float, float]:
    """``(threshold, edge_share, quality)`` on a stored curve: the point answering the most locally whose quality
    stays within ``max_quality_loss`` of cloud-only. With none, a threshold above every confidence (all escalate)."""
    curve = calibration.get("curve") or []
    cloud = calibration.get("cloud_only_quality")
    if not curve or not isinstance(cloud, int | float):
        raise ConflictError("this policy has no calibration curve to move the operating point on; calibrate it")
    best: dict[str, Any] | None = None
    for point in curve:
        if point.get("threshold") is None or point["quality"] < cloud - max_quality_loss - QUALITY_EPS:
            continue
        if best is None or point["edge_share"] > best["edge_share"]:
            best = point
    if best is not None:
        return float(best["threshold"]), float(best["edge_share"]), float(best["quality"])
    top = calibration.get("max_confidence")
    if not isinstance(top, int | float) or not math.isfinite(top):
        top = max((p["threshold"] for p in curve if p.get("threshold") is not None), default=0.0) + 1.0
    return float(np.nextafter(float(top), np.inf)), 0.0, float(cloud)


def move_operating_point(
    session: Session,
    model: str,
    *,
    max_quality_loss: float,
    actor: str,
    key: Ed25519PrivateKey,
    target: Iterable[Any] | None = None,
) -> EscalationPolicy:
    """A new version of ``model``'s policy at another point of the latest version's curve (no recalibration).
    ``target`` (default: the latest version's) lets the new point go to a part of the fleet only."""
    loss = check_loss(max_quality_loss)
    latest = get_version(session, model)
    policy = EdgePolicy.from_json(latest.policy)
    threshold, share, quality = operating_point(policy.calibration, loss)
    calibration = {
        **{k: v for k, v in policy.calibration.items() if k != "by_kind"},  # the per-kind shares were the old point's
        "max_quality_loss": loss,
        "edge_share": share,
        "quality": quality,
        "moved_from_version": latest.version,
    }
    moved = dataclasses.replace(policy, threshold=threshold, calibration=calibration)
    terms = check_target(list(target)) if target is not None else list(latest.target)
    return _store(
        session,
        moved,
        max_quality_loss=loss,
        data_sha256=latest.data_sha256,
        data_items=latest.data_items,
        target=terms,
        derived_from=latest.version,
        actor=actor,
        key=key,
        action="escalation_policy.move",
    )


def desired_rows(session: Session, device: Device) -> list[EscalationPolicy]:
    """Per model, the newest version whose target matches the device, unless a policy rollout governs the model:
    then the version of the device's sticky arm (the baseline outside the rollout's selector, the candidate once
    promoted, the baseline once rolled back or aborted). A version made after the rollout finished makes the
    first rule apply again."""
    chosen: dict[str, EscalationPolicy] = {}
    every: dict[tuple[str, int], EscalationPolicy] = {}
    query = select(EscalationPolicy).order_by(col(EscalationPolicy.model), col(EscalationPolicy.version).desc())
    for row in session.exec(query):
        every[(row.model, row.version)] = row
        if row.model not in chosen and matches(row.target, device.labels or {}, device.runtime or {}, device.id):
            chosen[row.model] = row
    plans = load_policy_plans(session) if every else []
    for model in {m for m, _ in every}:
        plan = plans_for(plans, model, device.tenant_id)
        if plan is None:
            continue
        newest = max((r for (m, _), r in every.items() if m == model), key=lambda r: r.version)
        ended = as_utc(plan.finished_at) if plan.status in FINAL and plan.finished_at is not None else None
        if ended is not None and as_utc(newest.created_at) > ended:
            continue  # made after the rollout ended: the newest targeting the device again
        assigned = every.get((model, int(edge_version(plan, device.id, device.tenant_id, device.labels or {}))))
        if assigned is not None:
            chosen[model] = assigned
    return [chosen[m] for m in sorted(chosen)]


def desired_for(session: Session, device: Device) -> list[DesiredPolicy]:
    return [
        DesiredPolicy(
            model=r.model,
            version=r.version,
            target=r.target,
            policy=r.policy,
            key_id=r.key_id,
            signature=r.signature,
        )
        for r in desired_rows(session, device)
    ]


def policy_json(row: EscalationPolicy, *, with_curve: bool = False) -> dict[str, Any]:
    cal = row.policy.get("calibration") or {}
    out: dict[str, Any] = {
        "model": row.model,
        "version": row.version,
        "signal": row.signal,
        "threshold": row.threshold,
        "max_quality_loss": row.max_quality_loss,
        "edge_share": cal.get("edge_share"),
        "quality": cal.get("quality"),
        "cloud_only_quality": cal.get("cloud_only_quality"),
        "data_sha256": row.data_sha256,
        "data_items": row.data_items,
        "target": row.target,
        "derived_from": row.derived_from,
        "key_id": row.key_id,
        "created_by": row.created_by,
        "created_at": row.created_at.isoformat(),
    }
    if with_curve:
        out["curve"] = cal.get("curve") or []
        out["policy"] = row.policy
    return out
