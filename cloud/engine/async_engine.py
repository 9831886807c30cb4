"""``AsyncLLMEngine``: the step loop on its own thread, per-request async streams for the event loop.

Requests are handed to the engine thread through a command queue; acceptance (or the validation error /
``QueueFull``) comes back before the stream starts, so an API can still answer 4xx / 429. Each update is
pushed to the request's ``asyncio.Queue`` with ``call_soon_threadsafe``. Leaving the ``async for`` early
(client disconnect, cancellation) aborts the request and frees its KV blocks at once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import logging
import queue
import threading
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Any

from cloud.engine.config import EngineConfig
from cloud.engine.llm_engine import LLMEngine
from cloud.engine.outputs import RequestOutput
from cloud.engine.sampling_params import SamplingParams
from shared.errors import ServiceUnavailableError

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]

    def put(self, item: RequestOutput | BaseException) -> None:
        with contextlib.suppress(RuntimeError):  # the caller's loop is closed: nobody is listening any more
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class AsyncLLMEngine:
    """Wraps one ``LLMEngine``; ``generate`` is safe to call from any number of coroutines."""

    def __init__(self, engine: LLMEngine, name: str = "engine") -> None:
        self.engine = engine
        self.name = name
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._ids = itertools.count()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name=f"tierline-{name}", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, config: EngineConfig, name: str | None = None) -> AsyncLLMEngine:
        return cls(LLMEngine(config), name or config.model_dir.name)

    # -- event-loop side ----------------------------------------------------------------------------------------
    def _call(self, fn: Callable[[], Any]) -> concurrent.futures.Future[Any]:
        if self._closed:
            raise ServiceUnavailableError(f"engine {self.name} is shut down")
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()

        def run() -> None:
            try:
                fut.set_result(fn())
            except BaseException as exc:
                fut.set_exception(exc)

        self._commands.put(run)
        self._wake.set()
        return fut

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Stream updates for one request; the last one has ``finished`` set and the final usage."""
        rid = request_id or f"{self.name}-{next(self._ids)}"
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._streams[rid] = stream

        def add() -> None:
            self.engine.add_request(rid, prompt, params, priority=priority, cache_salt=cache_salt)

        finished = False
        try:
            await asyncio.wrap_future(self._call(add))
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(rid, None)
            if not finished and not self._closed:
                self._call(lambda: self.engine.abort_request(rid))

    async def abort(self, request_id: str) -> None:
        await asyncio.wrap_future(self._call(lambda: self.engine.abort_request(request_id)))

    async def metrics(self) -> dict[str, Any]:
        result: dict[str, Any] = await asyncio.wrap_future(self._call(self.engine.metrics))
        return result

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the loop thread; requests still in flight get ServiceUnavailableError."""
        if self._closed:
            return
        self._closed = True
        self._wake.set()
        self._thread.join(timeout)

    # -- engine-thread side -------------------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._closed:
            while True:
                try:
                    self._commands.get_nowait()()
                except queue.Empty:
                    break
            if not self.engine.has_unfinished_requests():
                self._wake.wait(timeout=1.0)
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as exc:
                logger.exception("engine %s step failed; failing the requests in flight", self.name)
                self._fail_all(ServiceUnavailableError(f"engine {self.name} failed: {type(exc).__name__}"))
                continue
            self._deliver(outputs)
        self._fail_all(ServiceUnavailableError(f"engine {self.name} is shut down"))

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """One wake-up per event loop per step (not one per request): fewer cross-thread hops under load."""
        by_loop: dict[
            asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[RequestOutput | BaseException], RequestOutput]]
        ]
        by_loop = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                by_loop.setdefault(stream.loop, []).append((stream.queue, out))
        for loop, items in by_loop.items():
            with contextlib.suppress(RuntimeError):  # that loop is closed: nobody is listening any more
                loop.call_soon_threadsafe(_put_all, items)

    def _fail_all(self, exc: BaseException) -> None:
        for rid in list(self.engine._requests):
            self.engine.abort_request(rid)
        for stream in list(self._streams.values()):
            stream.put(exc)


def _put_all(items: list[tuple[asyncio.Queue[RequestOutput | BaseException], RequestOutput]]) -> None:
    for stream_queue, out in items:
        stream_queue.put_nowait(out)
