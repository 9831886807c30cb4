"""Which edge release of each model a device should run: read by the devices' gateway at every sync and by the
console's fleet page (desired vs actual), from the database alone.

Per model: the most recently *published* version that targets the device (``controlplane.fleet.targets``), unless a
rollout covering the edge governs the model — then the device's sticky arm's version (the baseline outside the
selector; the candidate once promoted, the baseline once rolled back or aborted). A publish after the rollout
finished makes the first rule apply again. A version a rollout names but nobody published is left out, so devices
keep what they run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from sqlmodel import Session, col, select

from controlplane.fleet.targets import release_targets, targets_device
from controlplane.rollouts.service import FINAL, edge_version, load_plans, plans_for
from controlplane.storage.tables import Device, EdgePublish, EdgeRelease


@dataclass(frozen=True, slots=True)
class Release:
    name: str
    version: str
    sha256: str
    published_at: float


def published_releases(session: Session) -> list[Release]:
    """Every publish, oldest first (a version published again appears again: that is a rollback by hand)."""
    rows = session.exec(
        select(EdgePublish, EdgeRelease.sha256)
        .join(
            EdgeRelease,
            (col(EdgeRelease.name) == col(EdgePublish.name)) & (col(EdgeRelease.version) == col(EdgePublish.version)),
        )
        .order_by(col(EdgePublish.id))
    ).all()
    return [Release(p.name, p.version, sha, p.published_at.timestamp()) for p, sha in rows]


def desired_releases(
    session: Session, device: Device, unpublished: Callable[[int, str, str], None] | None = None
) -> list[Release]:
    """The release of each model ``device`` should run, by name; ``unpublished(plan_id, name, version)`` hears of a
    rollout arm whose version nobody published."""
    releases = published_releases(session)
    if not releases:
        return []
    targets = release_targets(session)
    newest: dict[str, Release] = {}
    published: dict[tuple[str, str], Release] = {}
    for release in releases:
        published[(release.name, release.version)] = release
        if targets_device(targets.get((release.name, release.version)), device):
            newest[release.name] = release
    if not newest:
        return []
    plans = load_plans(session, "edge")
    chosen: list[Release] = []
    for name, release in sorted(newest.items()):
        plan = plans_for(plans, name, device.tenant_id)
        published_after_end = (
            plan is not None
            and plan.status in FINAL
            and plan.finished_at is not None
            and release.published_at > plan.finished_at.timestamp()
        )
        if plan is None or published_after_end:
            chosen.append(release)
            continue
        version = edge_version(plan, device.id, device.tenant_id, device.labels)
        assigned = published.get((name, version))
        if assigned is not None:
            chosen.append(assigned)
        elif unpublished is not None:
            unpublished(plan.id, name, version)
    return chosen
