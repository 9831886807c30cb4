"""Dynamic batching in Triton's model: concurrent requests' rows are stacked into one model run.

A request is an array of one or more rows. The batcher waits at most ``max_queue_delay_ms`` after a request
arrives for others to join it, stacks whole requests (in arrival order) along axis 0 up to ``max_batch_size``
rows, runs the batch in a worker thread so the event loop never blocks, and hands each request its own rows of
the output. One batch runs at a time; the next one forms while it runs.

A request with more rows than ``max_batch_size`` is **split**: it runs as consecutive chunks of
``max_batch_size`` rows (its last, smaller chunk may share a batch with the requests behind it), and its result is
the chunks' outputs concatenated. If any chunk fails, the request fails.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import numpy as np

from shared.errors import ApplicationError, ConfigurationError, RateLimitError, ServiceUnavailableError, ValidationError

logger = logging.getLogger(__name__)


@dataclass(slots=True, eq=False)
class _Request:
    rows: np.ndarray
    future: asyncio.Future[np.ndarray]
    enqueued_at: float
    num_taken: int = 0  # rows handed to batches so far
    num_done: int = 0  # rows whose outputs came back
    outputs: list[np.ndarray] = field(default_factory=list)

    @property
    def num_rows(self) -> int:
        return int(self.rows.shape[0])

    @property
    def signature(self) -> tuple[tuple[int, ...], np.dtype[Any]]:
        """Rows stack only with rows of the same trailing shape and dtype."""
        return self.rows.shape[1:], self.rows.dtype


@dataclass(slots=True)
class _Part:
    request: _Request
    start: int
    stop: int

    @property
    def rows(self) -> np.ndarray:
        return self.request.rows[self.start : self.stop]


class DynamicBatcher:
    """Merges concurrent ``submit`` calls into batches for ``run_batch``.

    Args:
        run_batch: the model: rows ``[N, ...]`` in, outputs ``[N, ...]`` out (e.g. ``OnnxRunner.run``). Called in
            the batcher's own worker thread, one batch at a time.
        max_batch_size: the most rows in one batch.
        max_queue_delay_ms: how long a request may wait for others to fill its batch; 0 runs what is queued as soon
            as the worker is free.
        max_queue_size: the most requests waiting (the batch running is not counted); beyond it ``submit`` raises
            ``RateLimitError``.
        validate: optional check of one request's rows before it is queued (e.g. ``OnnxRunner.check``), so a bad
            request fails alone with its ``ValidationError`` instead of failing a batch.

    ``start``, ``submit`` and ``close`` must be called on the same event loop. ``async with`` starts and closes.
    """

    def __init__(
        self,
        run_batch: Callable[[np.ndarray], np.ndarray],
        max_batch_size: int,
        max_queue_delay_ms: float,
        max_queue_size: int,
        *,
        validate: Callable[[np.ndarray], object] | None = None,
    ) -> None:
        if max_batch_size < 1:
            raise ConfigurationError(f"max_batch_size must be at least 1, got {max_batch_size}")
        if not max_queue_delay_ms >= 0:
            raise ConfigurationError(f"max_queue_delay_ms must be 0 or more, got {max_queue_delay_ms}")
        if max_queue_size < 1:
            raise ConfigurationError(f"max_queue_size must be at least 1, got {max_queue_size}")
        self.max_batch_size = max_batch_size
        self.max_queue_delay_ms = max_queue_delay_ms
        self.max_queue_size = max_queue_size
        self._run_batch = run_batch
        self._validate = validate
        self._delay_s = max_queue_delay_ms / 1000.0
        self._queue: deque[_Request] = deque()
        self._num_queued_rows = 0
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._is_closing = False
        self._run_s = 0.0
        self.num_requests = 0
        self.num_rejected = 0
        self.num_batches = 0
        self.num_failed_batches = 0
        self.num_batch_rows = 0
        self.max_batch_rows = 0  # the largest batch run so far

    @property
    def is_running(self) -> bool:
        return self._task is not None and not self._task.done() and not self._is_closing

    @property
    def num_queued(self) -> int:
        """Requests waiting for a batch."""
        return len(self._queue)

    @property
    def mean_batch_size(self) -> float:
        """Mean rows per batch run so far (0.0 before the first)."""
        return self.num_batch_rows / self.num_batches if self.num_batches else 0.0

    async def start(self) -> None:
        """Start the batching task on the running event loop."""
        if self._is_closing:
            raise ServiceUnavailableError("the batcher is closed; make a new one")
        if self._task is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tensor-batch")
            self._task = asyncio.create_task(self._serve(), name="dynamic-batcher")

    async def close(self, *, drain: bool = True) -> None:
        """Stop taking requests and wait for the batching task to end.

        Args:
            drain: run every queued request first (True), or fail them with ``ServiceUnavailableError`` (False).
                The batch already running always finishes: a model run in a thread cannot be interrupted.
        """
        self._is_closing = True
        if self._task is None:
            return
        if not drain:
            self._fail_queued(ServiceUnavailableError("the batcher closed before this request ran"))
        self._wakeup.set()
        try:
            await asyncio.shield(self._task)
        finally:
            if self._task.done():
                self._task = None
                if self._executor is not None:
                    self._executor.shutdown(wait=False)
                    self._executor = None

    async def __aenter__(self) -> DynamicBatcher:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def submit(self, rows: np.ndarray) -> np.ndarray:
        """Queue one request's rows ``[n, ...]`` (n >= 1) and return its outputs ``[n, ...]``.

        Raises:
            ValidationError: not an array of at least one row, or rejected by ``validate``.
            RateLimitError: ``max_queue_size`` requests are already waiting.
            ServiceUnavailableError: the batcher is not running, or closed without draining this request.
            Exception: whatever ``run_batch`` raised for the batch this request was in.
        """
        if not self.is_running:
            raise ServiceUnavailableError("the batcher is not running")
        if not isinstance(rows, np.ndarray) or rows.ndim < 1 or rows.shape[0] < 1:
            shape = list(rows.shape) if isinstance(rows, np.ndarray) else type(rows).__name__
            raise ValidationError(f"a request must be an array of one or more rows, got {shape}")
        if self._validate is not None:
            self._validate(rows)
        if len(self._queue) >= self.max_queue_size:
            self.num_rejected += 1
            raise RateLimitError(
                f"the batch queue is full ({len(self._queue)} requests waiting); retry later",
                retry_after=self._retry_after(),
            )
        loop = asyncio.get_running_loop()
        request = _Request(rows, loop.create_future(), loop.time())
        self._queue.append(request)
        self._num_queued_rows += request.num_rows
        self.num_requests += 1
        self._wakeup.set()
        return await request.future

    def _retry_after(self) -> float:
        """Seconds until the queue has room: batches ahead times the mean batch time (or the delay)."""
        per_batch = max(self._delay_s, self._run_s / self.num_batches if self.num_batches else 0.0)
        return max(0.001, per_batch * math.ceil(self._num_queued_rows / self.max_batch_size))

    async def _serve(self) -> None:
        try:
            while await self._gather():
                parts = self._take_batch()
                if parts:
                    await self._run(parts)
        finally:
            self._fail_queued(ServiceUnavailableError("the batcher stopped"))

    async def _gather(self) -> bool:
        """Wait until a batch should run: full, the oldest request's delay is up, or closing. False: stop."""
        loop = asyncio.get_running_loop()
        while not self._queue:
            if self._is_closing:
                return False
            self._wakeup.clear()
            await self._wakeup.wait()
        deadline = self._queue[0].enqueued_at + self._delay_s
        while self._num_queued_rows < self.max_batch_size and not self._is_closing:
            remaining = deadline - loop.time()
            if remaining <= 0:
                break
            self._wakeup.clear()
            try:
                async with asyncio.timeout(remaining):
                    await self._wakeup.wait()
            except TimeoutError:
                break
        return True

    def _take_batch(self) -> list[_Part]:
        """Take whole requests from the head of the queue while they fit (a request over a batch: one chunk)."""
        parts: list[_Part] = []
        room = self.max_batch_size
        while self._queue and room > 0:
            request = self._queue[0]
            left = request.num_rows - request.num_taken
            if request.future.done():  # its caller gave up, or an earlier chunk of it failed
                self._queue.popleft()
                self._num_queued_rows -= left
                continue
            if parts and request.signature != parts[0].request.signature:
                break  # rows of another shape or dtype cannot be stacked: they start the next batch
            take = min(left, room)
            if take < left and parts:
                break
            parts.append(_Part(request, request.num_taken, request.num_taken + take))
            request.num_taken += take
            self._num_queued_rows -= take
            room -= take
            if request.num_taken == request.num_rows:
                self._queue.popleft()
        return parts

    async def _run(self, parts: list[_Part]) -> None:
        batch = parts[0].rows if len(parts) == 1 else np.concatenate([p.rows for p in parts])
        num_rows = int(batch.shape[0])
        self.num_batches += 1
        self.num_batch_rows += num_rows
        self.max_batch_rows = max(self.max_batch_rows, num_rows)
        started = time.perf_counter()
        try:
            out = await asyncio.get_running_loop().run_in_executor(self._executor, self._run_batch, batch)
            if not isinstance(out, np.ndarray) or out.ndim < 1 or out.shape[0] != num_rows:
                shape = list(out.shape) if isinstance(out, np.ndarray) else type(out).__name__
                raise ApplicationError(f"the model returned {shape} for a batch of {num_rows} rows")
        except asyncio.CancelledError:
            _fail(parts, ServiceUnavailableError("the batcher stopped while this request ran"))
            raise
        except Exception as exc:
            self.num_failed_batches += 1
            logger.warning("a batch of %d rows from %d requests failed: %r", num_rows, len(parts), exc)
            _fail(parts, exc)
            return
        finally:
            self._run_s += time.perf_counter() - started
        offset = 0
        for part in parts:
            request, size = part.request, part.stop - part.start
            piece, offset = out[offset : offset + size], offset + size
            if request.future.done():
                continue
            request.outputs.append(piece)
            request.num_done += size
            if request.num_done == request.num_rows:
                outputs = request.outputs
                request.future.set_result(outputs[0] if len(outputs) == 1 else np.concatenate(outputs))

    def _fail_queued(self, exc: Exception) -> None:
        for request in self._queue:
            if not request.future.done():
                request.future.set_exception(exc)
        self._queue.clear()
        self._num_queued_rows = 0


def _fail(parts: list[_Part], exc: BaseException) -> None:
    for part in parts:
        if not part.request.future.done():
            part.request.future.set_exception(exc)
