"""The device's half of the live quality monitor: a share of edge-answered inputs goes to the cloud in the
background (``POST /v1/edge/shadow``), so the cloud can answer them again and check the policy's promise.

- The share is the cloud's (``shadow_share`` in each sync answer; 0, the default, turns it off), and only
  inputs answered under a policy version the cloud delivered are sampled (an override or the default policy has
  no promise to check).
- Never on the client's path: ``offer`` only queues; one owned task sends. The queue is bounded: when it is full
  (the cloud is slow or unreachable) a new batch is dropped and counted, never the client's answer delayed.
- A batch carries an id chosen here and is retried under it (the cloud bills it once); a refusal (4xx, such as
  the per-device rate bound) drops it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from edge_agent.cloud_link import CloudLink, CloudUnavailableError
from shared.edge_protocol import MAX_SHADOW_ROWS

logger = logging.getLogger(__name__)
QUEUE_SIZE = 32
ATTEMPTS = 3
RETRY_S = 1.0


@dataclass(slots=True)
class ShadowStats:
    offered: int = 0
    sent: int = 0
    dropped: int = 0
    refused: int = 0


class ShadowSampler:
    """Samples edge answers and sends them to the cloud from one background task."""

    def __init__(
        self,
        link: Callable[[], CloudLink | None],
        share: Callable[[], float],
        policy_version: Callable[[str], int | None],
        queue_size: int = QUEUE_SIZE,
        draw: Callable[[], float] = random.random,
    ) -> None:
        self.link = link
        self.share = share
        self.policy_version = policy_version
        self.draw = draw
        self.stats = ShadowStats()
        self._queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue(queue_size)
        self._task: asyncio.Task[None] | None = None

    def offer(
        self, model: str, cloud_model: str, rows: np.ndarray, logits: np.ndarray, confidence: np.ndarray, at: float
    ) -> bool:
        """Queue the edge-answered ``rows`` of one request (with the edge's logits and the policy's confidence)
        when this request is drawn; True when it was queued."""
        share = self.share()
        if share <= 0 or len(rows) == 0 or self.link() is None:
            return False
        version = self.policy_version(model)
        if version is None or self.draw() >= share:
            return False
        self.stats.offered += 1
        keep = slice(0, MAX_SHADOW_ROWS)
        batch = {
            "id": uuid.uuid4().hex,
            "model": model,
            "cloud_model": cloud_model,
            "policy_version": version,
            "inputs": np.asarray(rows[keep], dtype=np.float64).tolist(),
            "edge_answers": np.argmax(logits[keep], axis=-1).astype(int).tolist(),
            "confidences": np.asarray(confidence[keep], dtype=np.float64).tolist(),
            "occurred_at": at,
        }
        try:
            self._queue.put_nowait(batch)
        except asyncio.QueueFull:
            self.stats.dropped += 1
            return False
        return True

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="edge-shadow-sampler")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        while True:
            batch = await self._queue.get()
            try:
                await self._send(batch)
            except Exception:
                logger.exception("sending a shadow batch failed; dropped")
                self.stats.dropped += 1

    async def _send(self, batch: dict[str, Any]) -> None:
        for attempt in range(ATTEMPTS):
            link = self.link()
            if link is None:
                break
            try:
                status = await link.shadow(batch)
            except CloudUnavailableError:
                await asyncio.sleep(RETRY_S * (attempt + 1))
                continue
            if status == 200:
                self.stats.sent += 1
            else:
                self.stats.refused += 1
                logger.info("the cloud refused a shadow batch (%d); dropped", status)
            return
        self.stats.dropped += 1

    def as_json(self) -> dict[str, Any]:
        return {
            "share": self.share(),
            "queued": self._queue.qsize(),
            "offered": self.stats.offered,
            "sent": self.stats.sent,
            "dropped": self.stats.dropped,
            "refused": self.stats.refused,
        }
