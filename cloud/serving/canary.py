"""Canary routing on the cloud: which version serves a request and which rollout arm it counts in, from rollout
plans kept in memory.

The plans (``controlplane.rollouts.service.load_plans(session, "cloud")``) are reloaded every ``ttl_s`` by a background
task in a worker thread, so routing a request is a pure function call
(``controlplane.rollouts.service.resolve_cloud_arm``,
sticky by tenant and the request's subject). After each reload the router hands the plans to its listeners in
that same worker thread (``cloud.serving.registry_models`` loads the versions a new rollout needs there).

- A zoo model carries no version: a request is counted in an arm (its usage record's ``rollout_arm``) only when
  that arm's version is the one served (``canary_arm``), which for a zoo model never happens.
- A registry model has one engine per loaded version: the arm's version serves the request (``route_registry``).
- At a rollout's shadow step a sample of the baseline's requests is mirrored to the candidate: ``shadow_target``
  picks them (a routing decision, so it lives here), the router's ``mirror`` (``cloud.serving.shadow``) runs them and is
  closed with it.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Final, Protocol

from sqlalchemy.engine import Engine
from sqlmodel import Session

from cloud.serving.shadow import ShadowMirror
from controlplane.rollouts.assignment import EXCLUDED
from controlplane.rollouts.service import RolloutPlan, load_plans, plans_for, resolve_cloud_arm
from shared.edge_protocol import version_number
from shared.periodic import Periodic

if TYPE_CHECKING:  # the engines (torch) load only where requests are served
    from cloud.serving.engine_pool import RegistryEntry

logger = logging.getLogger(__name__)


class Routable(Protocol):
    """What routing reads of a registry model: an LLM's ``RegistryEntry`` or a tensor model's ``TensorEntry``."""

    @property
    def name(self) -> str: ...

    @property
    def versions(self) -> Mapping[int, object]: ...

    @property
    def default(self) -> int | None: ...

    @property
    def stable_moved_at(self) -> datetime | None: ...

    @property
    def loaded(self) -> frozenset[int]: ...


FINISHED: Final = ("promoted", "rolled_back", "aborted")
ROUTING: Final = ("pending", "running", "paused")


class CanaryRouter:
    def __init__(self, engine: Engine, ttl_s: float = 5.0) -> None:
        self.engine = engine
        self.ttl_s = ttl_s
        self._plans: list[RolloutPlan] = []
        self._refresher = Periodic("reading rollout plans", lambda: self.refresh(), ttl_s)
        self.listeners: list[Callable[[list[RolloutPlan]], None]] = []
        self.mirror = ShadowMirror(engine)

    @property
    def plans(self) -> list[RolloutPlan]:
        return self._plans

    def refresh(self) -> None:
        with Session(self.engine) as session:
            self._plans = load_plans(session, "cloud")
        for listener in self.listeners:
            try:
                listener(self._plans)
            except Exception:
                logger.exception("acting on the new rollout plans failed; will try again at the next refresh")

    async def start(self) -> None:
        await self._refresher.start()

    async def close(self) -> None:
        await self.mirror.close()
        await self._refresher.close()

    def arm(self, model: str, served_version: str | None, tenant_id: int, subject: str | None) -> str | None:
        """The arm to stamp on the request's usage record (see ``canary_arm``)."""
        return canary_arm(self._plans, model, served_version, tenant_id, subject) if self._plans else None

    def route(self, entry: Routable, tenant_id: int, subject: str | None) -> tuple[int | None, str | None]:
        """The version of a registry model that serves the request, and its arm (see ``route_registry``)."""
        return route_registry(self._plans, entry, tenant_id, subject)

    def shadow(self, entry: RegistryEntry, tenant_id: int, served_version: int | None) -> tuple[int, int] | None:
        """(rollout id, candidate version) when this request is sampled for its rollout's shadow step."""
        return shadow_target(self._plans, entry, tenant_id, served_version) if self._plans else None


def canary_arm(
    plans: Sequence[RolloutPlan], model: str, served_version: str | None, tenant_id: int, subject: str | None
) -> str | None:
    """The arm a cloud request counts in: None outside a rollout, and None when the arm's version is not the one
    that serves it (a version this cloud does not load, or a cloud whose models carry no version)."""
    route = resolve_cloud_arm(plans, model=model, tenant_id=tenant_id, subject=subject)
    if route is None or route.arm is None or served_version is None or route.version != served_version:
        return None
    return str(route.arm)


def governing_plan(plans: Sequence[RolloutPlan], entry: Routable, tenant_id: int) -> RolloutPlan | None:
    """The rollout that decides a tenant's requests for ``entry``'s model, or None: the default version serves.

    A finished rollout keeps deciding (a promoted candidate serves everyone) until the ``stable`` alias is
    moved after it finished: the later decision wins.
    """
    plan = plans_for(plans, entry.name, tenant_id)
    if plan is None:
        return None
    if (
        plan.status in FINISHED
        and plan.finished_at is not None
        and entry.stable_moved_at is not None
        and entry.stable_moved_at > plan.finished_at
    ):
        return None
    return plan


def route_registry(
    plans: Sequence[RolloutPlan], entry: Routable, tenant_id: int, subject: str | None
) -> tuple[int | None, str | None]:
    """(version that serves the request, arm to stamp on its usage record) for a request to a registry model.

    Outside a rollout: the default version, no arm. In a running or paused rollout whose two versions are both
    loaded: the sticky arm's version, stamped with the arm. While one of them is still loading (a rollout created
    after start-up): the baseline, counted in no arm. Pending, rolled back, aborted: the baseline; promoted: the
    candidate; no arm either way. A version that is not loaded falls back to the baseline, then the default.
    """
    plan = governing_plan(plans, entry, tenant_id)
    if plan is None:
        return entry.default, None
    loaded = entry.loaded
    baseline, candidate = version_number(plan.baseline_version), version_number(plan.candidate_version)
    fallback = baseline if baseline in loaded else entry.default
    route = resolve_cloud_arm([plan], model=entry.name, tenant_id=tenant_id, subject=subject)
    if route is None:
        return entry.default, None
    if route.arm is not None and (baseline not in loaded or candidate not in loaded):
        return fallback, None
    version = version_number(route.version)
    if version not in loaded:
        return fallback, None
    return version, str(route.arm) if route.arm is not None else None


def shadow_target(
    plans: Sequence[RolloutPlan],
    entry: RegistryEntry,
    tenant_id: int,
    served_version: int | None,
    draw: Callable[[], float] = random.random,
) -> tuple[int, int] | None:
    """(rollout id, candidate version) to mirror a request to, or None.

    A request is mirrored when the rollout that governs the model for the tenant is at its shadow step, the
    baseline served the request, the candidate is loaded, the tenant is not excluded, and the draw (uniform in
    [0, 1)) falls within the shadow sample.
    """
    plan = governing_plan(plans, entry, tenant_id)
    if plan is None or not plan.shadowing or plan.tenant_pins.get(tenant_id) == EXCLUDED:
        return None
    baseline, candidate = version_number(plan.baseline_version), version_number(plan.candidate_version)
    if served_version is None or served_version != baseline or candidate is None or candidate not in entry.versions:
        return None
    if draw() * 100 >= plan.shadow_sample:
        return None
    return plan.id, candidate


def routed_versions(plans: Sequence[RolloutPlan], entry: RegistryEntry) -> set[int]:
    """The versions of ``entry``'s model that rollouts may route requests to (for any tenant): both arms of a
    pending, running or paused rollout; the version a finished rollout still serves."""
    needed: set[int] = set()
    for plan in plans:
        if plan.model.removeprefix("tierline/") != entry.name:
            continue
        if plan.status in ROUTING:
            versions = {plan.baseline_version, plan.candidate_version}
        elif governing_plan([plan], entry, plan.tenant_id or 0) is None:
            continue
        else:
            versions = {plan.candidate_version if plan.status == "promoted" else plan.baseline_version}
        needed.update(n for n in map(version_number, versions) if n is not None)
    return needed
