"""A background task that runs a blocking function in a worker thread every so often, off the event loop.

The price book, the cloud's rollout plans and the budget sweeper all keep something fresh this way: the
database is read in a worker thread, never on the event loop; a failure is logged and tried again at the next
tick, so a database that comes up late or blips never stops the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

logger = logging.getLogger(__name__)


class Periodic:
    """Call ``fn`` in a worker thread, then again ``interval_s`` after each call ends, until ``close()``.

    Args:
        name: names the asyncio task and the log line of a failure, e.g. ``"reading the price book"``.
    """

    def __init__(self, name: str, fn: Callable[[], object], interval_s: float) -> None:
        self.name = name
        self.fn = fn
        self.interval_s = interval_s
        self._task: asyncio.Task[None] | None = None

    @property
    def is_running(self) -> bool:
        return self._task is not None

    async def start(self, *, wait_for_first: bool = True) -> None:
        """Run ``fn`` once (awaited; with ``wait_for_first=False`` in the background), then every ``interval_s``."""
        if wait_for_first:
            await self._tick()
        self._task = asyncio.create_task(self._run(tick_first=not wait_for_first), name=self.name)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _tick(self) -> None:
        try:
            await asyncio.to_thread(self.fn)
        except Exception:
            logger.exception("%s failed; trying again in %.0f s", self.name, self.interval_s)

    async def _run(self, tick_first: bool) -> None:
        if tick_first:
            await self._tick()
        while True:
            await asyncio.sleep(self.interval_s)
            await self._tick()
