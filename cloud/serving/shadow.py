"""The shadow step of a cloud rollout: a sample of the requests the baseline served is mirrored to the
candidate, and the candidate's greedy tokens are compared with the baseline's — before any user sees it.

While a rollout is at its shadow step (step 0, weight 0, ``shadow_sample`` > 0) every user is served by the
baseline. Once the answer to a greedy request sampled by ``cloud.serving.canary.shadow_target`` is complete,
:class:`ShadowMirror` runs the same prompt on the candidate in the background (temperature 0, as many tokens as the
baseline generated) and records one ``rollout_shadow_sample``: the share of the baseline's positions where the
candidate produced the same token. The user's answer is never delayed or changed, the mirror is never billed (no
usage record, no rate limit or budget charge) and never counted in an arm. Mirrors run one at a time; when the small
queue is full a mirror is dropped (the sample is a sample).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from sqlalchemy.engine import Engine
from sqlmodel import Session

from controlplane.rollouts.analysis import token_agreement
from controlplane.storage.tables import RolloutShadowSample

if TYPE_CHECKING:  # the engines (torch) load only where requests are served
    from cloud.serving.engine_pool import ServedLM

logger = logging.getLogger(__name__)

QUEUE_SIZE: Final = 8
WORKERS: Final = 1


async def greedy_tokens(served: ServedLM, prompt: list[int], max_tokens: int, prefix: str, salt: str) -> list[int]:
    """``served``'s greedy answer to ``prompt`` (``max_tokens`` ids) in prefix-cache namespace ``salt``: work no
    client sees (a rollout's shadow mirror, the quality monitor's replay), under a request id starting ``prefix``."""
    from cloud.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    tokens: list[int] = []
    stream = served.engine.generate(prompt, params, request_id=f"{prefix}-{uuid.uuid4().hex}", cache_salt=salt)
    try:
        async for out in stream:
            if out.finished:
                tokens = list(out.outputs[0].token_ids)
    finally:
        await stream.aclose()
    return tokens


@dataclass(frozen=True, slots=True)
class Mirror:
    """One request to replay on the candidate: its prompt's token ids and the baseline's generated tokens."""

    rollout_id: int
    candidate: ServedLM
    prompt: list[int]
    baseline: list[int]


class ShadowMirror:
    """Runs mirrors in the background, at most ``workers`` at once, dropping them when ``queue_size`` wait."""

    def __init__(self, db: Engine, queue_size: int = QUEUE_SIZE, workers: int = WORKERS) -> None:
        self.db = db
        self.queue_size = queue_size
        self.workers = workers
        self.recorded = 0
        self.dropped = 0
        self._queue: asyncio.Queue[Mirror] | None = None
        self._tasks: list[asyncio.Task[None]] = []

    def submit(self, mirror: Mirror) -> bool:
        """Queue a mirror (from the event loop); False when the queue is full and it was dropped."""
        if self._queue is None:
            self._queue = asyncio.Queue(self.queue_size)
            self._tasks = [asyncio.create_task(self._work(), name=f"shadow-{i}") for i in range(self.workers)]
        try:
            self._queue.put_nowait(mirror)
        except asyncio.QueueFull:
            self.dropped += 1
            return False
        return True

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
        self._queue = None

    async def _work(self) -> None:
        assert self._queue is not None
        while True:
            mirror = await self._queue.get()
            try:
                await self._run(mirror)
            except Exception:
                logger.exception("shadow mirror for rollout %s failed; the sample is skipped", mirror.rollout_id)

    async def _run(self, mirror: Mirror) -> None:
        tokens = await greedy_tokens(mirror.candidate, mirror.prompt, len(mirror.baseline), "shadow", "shadow")
        agreement = token_agreement(mirror.baseline, tokens)
        if agreement is None:
            return
        matches = round(agreement * len(mirror.baseline))
        await asyncio.to_thread(self._record, mirror.rollout_id, len(mirror.baseline), matches, agreement)
        self.recorded += 1

    def _record(self, rollout_id: int, positions: int, matches: int, agreement: float) -> None:
        with Session(self.db) as session:
            session.add(
                RolloutShadowSample(rollout_id=rollout_id, positions=positions, matches=matches, agreement=agreement)
            )
            session.commit()
