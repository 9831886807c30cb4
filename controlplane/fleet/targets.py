"""Release targets: which devices a published edge release (artifact name and version) is for.

A release with no target goes to every device, as before; one with a target (``shared.targeting``) only to the
devices whose labels and reported facts match it. Set a release's target before publishing it
(``tierline devices target-release NAME VERSION --target ring=beta``, ``tierline cloud publish … --target``, the
console's fleet page or ``PUT /api/releases/{name}/{version}/target``), so no device outside it ever hears of it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from sqlmodel import Session, col, select

from controlplane.storage.audit import audit
from controlplane.storage.tables import Device, EdgePublish, EdgeRelease, ReleaseTarget
from shared.errors import ValidationError
from shared.targeting import check_target, describe, matches


def set_release_target(
    session: Session, name: str, version: str, target: Iterable[Any], *, actor: str
) -> ReleaseTarget | None:
    """Target ``name`` ``version`` at the devices ``target`` selects (an empty target: every device again)."""
    if not name or not version or len(name) > 128 or len(version) > 128:
        raise ValidationError("a release is an artifact name and a version", param="name")
    terms = check_target(list(target))
    row = session.exec(
        select(ReleaseTarget).where(ReleaseTarget.name == name, ReleaseTarget.version == version)
    ).first()
    before = {"target": describe(row.target)} if row is not None else None
    if not terms:
        if row is not None:
            session.delete(row)
    elif row is None:
        row = ReleaseTarget(name=name, version=version, target=terms, created_by=actor[:128])
        session.add(row)
    else:
        row.target = terms
        session.add(row)
    audit(session, actor, "release.target", f"release/{name}/{version}", before, {"target": describe(terms)})
    return row if terms else None


def release_targets(session: Session) -> dict[tuple[str, str], list[dict[str, str]]]:
    return {(r.name, r.version): r.target for r in session.exec(select(ReleaseTarget))}


def targets_device(target: list[dict[str, str]] | None, device: Device) -> bool:
    return not target or matches(target, device.labels or {}, device.runtime or {}, device.id)


def release_target_rows(session: Session) -> list[dict[str, Any]]:
    """Every stored edge release (newest first) with its target (``[]``: every device) and whether it has been
    published, and the targets set ahead of a release not stored yet."""
    targets = release_targets(session)
    published = {(n, v) for n, v in session.exec(select(EdgePublish.name, EdgePublish.version).distinct())}
    rows = []
    seen = set()
    for r in session.exec(select(EdgeRelease).order_by(col(EdgeRelease.id).desc())):
        seen.add((r.name, r.version))
        rows.append(_row(r.name, r.version, targets.get((r.name, r.version)), (r.name, r.version) in published))
    rows.extend(_row(n, v, t, False) for (n, v), t in sorted(targets.items()) if (n, v) not in seen)
    return rows


def _row(name: str, version: str, target: list[dict[str, str]] | None, published: bool) -> dict[str, Any]:
    terms = list(target or [])
    return {
        "name": name,
        "version": version,
        "target": [f"{t['key']}{t['op']}{t['value']}" for t in terms],
        "describe": describe(terms),
        "published": published,
    }
