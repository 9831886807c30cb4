"""The rollout controller: a background task of the console process that runs one controller pass
(``controlplane.rollouts.service.run_controller_pass``: start pending rollouts, judge running ones, advance, promote or
roll back) every ``TIERLINE_CONSOLE_ROLLOUT_INTERVAL_S`` seconds.

The task is owned by the app's lifespan and stopped with it: a stop lets a pass in flight finish (it runs in
a worker thread and commits transition by transition), then ends the loop. Several console replicas may run
it at once: transitions are conditional on each rollout's revision, so none is applied twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict
from sqlalchemy.engine import Engine

from controlplane.rollouts.service import run_controller_pass

logger = logging.getLogger(__name__)

STOP_TIMEOUT_S = 30.0


class RolloutControllerSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TIERLINE_CONSOLE_", extra="ignore")

    rollout_interval_s: float = Field(15.0, gt=0, description="seconds between two rollout controller passes")


class RolloutController:
    """Runs a controller pass every ``interval_s`` seconds until stopped."""

    def __init__(self, engine: Engine, interval_s: float) -> None:
        self.engine = engine
        self.interval_s = interval_s
        self.num_passes = 0
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._stop.clear()
        self._task = asyncio.create_task(self._run(), name="rollout-controller")
        logger.info("rollout controller: a pass every %gs", self.interval_s)

    async def stop(self) -> None:
        self._stop.set()
        if self._task is None:
            return
        try:
            await asyncio.wait_for(asyncio.shield(self._task), STOP_TIMEOUT_S)
        except TimeoutError:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._task = None

    async def _run(self) -> None:
        while not self._stop.is_set():
            try:
                results = await asyncio.to_thread(run_controller_pass, self.engine)
            except Exception:
                logger.exception("rollout controller pass failed; trying again next interval")
            else:
                self.num_passes += 1
                for r in results:
                    if r.action != "wait":
                        logger.info("rollout %s: %s (%s)", r.rollout_id, r.action, r.reason)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), self.interval_s)


@asynccontextmanager
async def rollout_controller(db: Engine) -> AsyncIterator[None]:
    """The controller runs while the console serves."""
    controller = RolloutController(db, RolloutControllerSettings().rollout_interval_s)
    await controller.start()
    try:
        yield
    finally:
        await controller.stop()
