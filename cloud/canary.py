"""Canary routing on the cloud: which rollout arm a request falls in, from rollout plans kept in memory.

The plans (``shared.rollouts.load_plans(session, "cloud")``) are reloaded every ``ttl_s`` by a background
task in a worker thread, so routing a request is a pure function call (``shared.rollouts.resolve_cloud_arm``,
sticky by tenant and the request's subject). The cloud serves one version of each model; a request is counted
in an arm (its usage record's ``rollout_arm``) only when that arm's version is the one served, so a rollout's
analysis never sees answers from a version it did not pick.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence

from sqlalchemy.engine import Engine
from sqlmodel import Session

from shared.rollouts import RolloutPlan, load_plans, resolve_cloud_arm

logger = logging.getLogger(__name__)


class CanaryRouter:
    def __init__(self, engine: Engine, ttl_s: float = 5.0) -> None:
        self.engine = engine
        self.ttl_s = ttl_s
        self._plans: list[RolloutPlan] = []
        self._task: asyncio.Task[None] | None = None

    def refresh(self) -> None:
        with Session(self.engine) as session:
            self._plans = load_plans(session, "cloud")

    async def start(self) -> None:
        try:
            await asyncio.to_thread(self.refresh)
        except Exception:
            logger.exception("reading rollout plans failed; requests are served without canary routing")
        self._task = asyncio.create_task(self._run(), name="canary-plans")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.ttl_s)
            try:
                await asyncio.to_thread(self.refresh)
            except Exception:
                logger.exception("reading rollout plans failed; the previous plans stay in use")

    def arm(self, model: str, served_version: str | None, tenant_id: int, subject: str | None) -> str | None:
        """The arm to stamp on the request's usage record (see ``canary_arm``)."""
        return canary_arm(self._plans, model, served_version, tenant_id, subject) if self._plans else None


def canary_arm(
    plans: Sequence[RolloutPlan], model: str, served_version: str | None, tenant_id: int, subject: str | None
) -> str | None:
    """The arm a cloud request counts in: None outside a rollout, and None when the arm's version is not the one
    that serves it (a version this cloud does not load, or a cloud whose models carry no version)."""
    route = resolve_cloud_arm(plans, model=model, tenant_id=tenant_id, subject=subject)
    if route is None or route.arm is None or served_version is None or route.version != served_version:
        return None
    return str(route.arm)
