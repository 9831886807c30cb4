"""The device's half of the live quality monitor: a share of edge-answered inputs goes to the cloud in the
background (``POST /v1/edge/shadow``), so the cloud can answer them again and check the policy's promise.

- The share is the cloud's (``shadow_share`` in each sync answer; 0, the default, turns it off), and only
  inputs answered under a policy version the cloud delivered are sampled (an override or the default policy has
  no promise to check).
- Never on the client's path: ``offer`` only queues; one owned task sends. The queue is bounded: when it is full
  (the cloud is slow or unreachable) a new batch is dropped and counted, never the client's answer delayed.
- A batch carries an id chosen here and is retried under it (the cloud bills it once); a refusal (4xx, such as
  the per-device rate bound) drops it.
- A refusal that says the device may not replay now (429: a budget cannot cover the batch, ``insufficient_quota``,
  or the tenant's shadow share or rate bound is used up; 403: replays are off; 402) also pauses sampling: nothing
  is offered or sent for ``PAUSE_S`` seconds, doubling with each refusal up to ``MAX_PAUSE_S`` (back to
  ``PAUSE_S`` after a batch is answered), or until the next sync says the allowance is back (``on_allowance``).
  A refused batch is never retried, and an exhausted budget costs the cloud one refusal per pause, not a loop.
- LM answers (``offer_lm``): only greedy, unconstrained generations (the calibration's promise is about the greedy
  answer; a sampled or grammar-forced one says nothing about it); the batch carries the prompt's token ids, the
  first ``MAX_SHADOW_TOKENS`` generated ids and the edge vocabulary's fingerprint, computed here in the background
  once per tokenizer. A pair the cloud refuses with 409 (different vocabularies: token ids cannot be compared) is
  not sampled again until the agent restarts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
import uuid
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from edge_agent.cloud_link import CloudLink, CloudUnavailableError
from shared.edge_protocol import MAX_SHADOW_ROWS, MAX_SHADOW_TOKENS, Allowance, vocabulary_sha256

logger = logging.getLogger(__name__)
QUEUE_SIZE = 32
ATTEMPTS = 3
RETRY_S = 1.0
PAUSE_S = 30.0
MAX_PAUSE_S = 600.0
PAUSING = frozenset({402, 403, 429})  # the device may not replay now: over a budget, its share or rate; or off


@dataclass(slots=True)
class ShadowStats:
    offered: int = 0
    sent: int = 0
    dropped: int = 0
    refused: int = 0
    lm_offered: int = 0
    paused: int = 0  # refusals that paused sampling


class ShadowSampler:
    """Samples edge answers and sends them to the cloud from one background task."""

    def __init__(
        self,
        link: Callable[[], CloudLink | None],
        share: Callable[[], float],
        policy_version: Callable[[str], int | None],
        queue_size: int = QUEUE_SIZE,
        draw: Callable[[], float] = random.random,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.link = link
        self.share = share
        self.policy_version = policy_version
        self.draw = draw
        self.clock = clock
        self.paused_until = float("-inf")  # no batch is offered or sent before (a refusal's pause)
        self._pause_s = PAUSE_S
        self.stats = ShadowStats()
        self._queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue(queue_size)
        self._task: asyncio.Task[None] | None = None
        self._vocabularies: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()
        self.unmonitorable: set[tuple[str, str]] = set()  # (model, cloud model): vocabularies differ (409)

    def offer(
        self, model: str, cloud_model: str, rows: np.ndarray, logits: np.ndarray, confidence: np.ndarray, at: float
    ) -> bool:
        """Queue the edge-answered ``rows`` of one request (with the edge's logits and the policy's confidence)
        when this request is drawn; True when it was queued."""
        share = self.share()
        if share <= 0 or len(rows) == 0 or self.link() is None or self.is_paused:
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
        return self._put(batch)

    def offer_lm(
        self,
        model: str,
        cloud_model: str,
        prompt_ids: list[int],
        tokens: list[int],
        confidence: float,
        tokenizer: Any,
        at: float,
    ) -> bool:
        """Queue one edge-answered LM request (its prompt ids, generated ids and the policy's confidence) when it
        is drawn; ``tokenizer`` (the model's ``ChatTokenizer``) names the vocabulary the ids are in. True when queued.
        The caller offers greedy, unconstrained answers only."""
        share = self.share()
        if share <= 0 or not prompt_ids or not tokens or self.link() is None or self.is_paused:
            return False
        if (model, cloud_model) in self.unmonitorable:
            return False
        version = self.policy_version(model)
        if version is None or self.draw() >= share:
            return False
        self.stats.offered += 1
        self.stats.lm_offered += 1
        batch = {
            "id": uuid.uuid4().hex,
            "model": model,
            "cloud_model": cloud_model,
            "policy_version": version,
            "lm_samples": [
                {
                    "prompt_ids": [int(t) for t in prompt_ids],
                    "edge_tokens": [int(t) for t in tokens[:MAX_SHADOW_TOKENS]],
                    "confidence": float(confidence),
                }
            ],
            "vocabulary_sha256": tokenizer,  # replaced by its fingerprint in the background (_send)
            "occurred_at": at,
        }
        return self._put(batch)

    @property
    def is_paused(self) -> bool:
        return self.clock() < self.paused_until

    def on_allowance(self, allowance: Allowance | None) -> None:
        """A sync's allowance: one that is not used up (or none: unlimited) ends a pause."""
        if allowance is None or not allowance.is_exhausted:
            self.paused_until = float("-inf")

    def _pause(self, status: int) -> None:
        self.stats.paused += 1
        self.paused_until = self.clock() + self._pause_s
        logger.warning("the cloud refused a shadow batch (%d): sampling paused for %.0fs", status, self._pause_s)
        self._pause_s = min(MAX_PAUSE_S, self._pause_s * 2)

    def _put(self, batch: dict[str, Any]) -> bool:
        try:
            self._queue.put_nowait(batch)
        except asyncio.QueueFull:
            self.stats.dropped += 1
            return False
        return True

    async def _vocabulary(self, tokenizer: Any) -> str:
        found = self._vocabularies.get(tokenizer)
        if found is None:
            found = await asyncio.to_thread(vocabulary_sha256, tokenizer.tokenizer)
            self._vocabularies[tokenizer] = found
        return found

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
        if "lm_samples" in batch and not isinstance(batch["vocabulary_sha256"], str):
            batch["vocabulary_sha256"] = await self._vocabulary(batch["vocabulary_sha256"])
        for attempt in range(ATTEMPTS):
            link = self.link()
            if link is None or self.is_paused:  # queued before a refusal paused sampling: not sent
                break
            try:
                status = await link.shadow(batch)
            except CloudUnavailableError:
                await asyncio.sleep(RETRY_S * (attempt + 1))
                continue
            if status == 200:
                self.stats.sent += 1
                self._pause_s = PAUSE_S
            else:
                self.stats.refused += 1
                logger.info("the cloud refused a shadow batch (%d); dropped", status)
                if status in PAUSING:
                    self._pause(status)
                if status == 409 and "lm_samples" in batch:
                    self.unmonitorable.add((batch["model"], batch["cloud_model"]))
                    logger.warning(
                        "%s and %s cannot be compared token by token (different vocabularies); not sampled again",
                        batch["model"],
                        batch["cloud_model"],
                    )
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
            "lm_offered": self.stats.lm_offered,
            "paused": self.stats.paused,
            "paused_for_s": round(max(0.0, self.paused_until - self.clock()), 1),
            "unmonitorable": sorted(f"{m} -> {c}" for m, c in self.unmonitorable),
        }
