"""``AsyncLLMEngine``: the step loop on its own thread, per-request async streams for the event loop.

``EngineClient`` is what the API sees of an engine; ``cloud.engine.process.EngineProcess`` is the same client with
the step loop in a process of its own.

Requests are handed to the engine thread through a command queue; acceptance (or the validation error /
``QueueFull``) comes back before the stream starts, so an API can still answer 4xx / 429. Each update is
pushed to the request's ``asyncio.Queue`` with ``call_soon_threadsafe``. Leaving the ``async for`` early
(client disconnect, cancellation) aborts the request and frees its KV blocks at once.
"""

from __future__ import annotations

import abc
import asyncio
import concurrent.futures
import contextlib
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cloud.engine.config import EngineConfig
from cloud.engine.outputs import RequestOutput
from cloud.engine.protocol import (
    AbortRequest,
    AddRequest,
    EngineCoreRequest,
    EngineSnapshot,
    MetricsRequest,
    ShutdownRequest,
    StopSequences,
)
from cloud.engine.sampling_params import SamplingParams
from cloud.engine.tokenizer import ChatTokenizer
from shared.errors import ServiceUnavailableError

if TYPE_CHECKING:
    from cloud.engine.llm_engine import LLMEngine  # torch: imported where an engine is built, not by the API

logger = logging.getLogger(__name__)


def snapshot_of(engine: LLMEngine) -> EngineSnapshot:
    return EngineSnapshot(
        running=len(engine.scheduler.running),
        waiting=len(engine.scheduler.waiting),
        kv_usage=engine.block_manager.usage(),
        prefix_hit_rate=engine.block_manager.prefix_cache_hit_rate(),
        spec_proposed=dict(engine.stats.spec_proposed),
        spec_accepted=dict(engine.stats.spec_accepted),
    )


@dataclass(slots=True)
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]

    def put(self, item: RequestOutput | BaseException) -> None:
        with contextlib.suppress(RuntimeError):  # the caller's loop is closed: nobody is listening any more
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class EngineClient(abc.ABC):
    """What the API uses of an engine, wherever its step loop runs: per-request async streams (``generate``),
    the tokenizer and limits for validating before admission, and a load snapshot.

    Subclasses run the loop (``AsyncLLMEngine``: a thread of this process; ``EngineProcess``: a process of its own)
    and implement ``_submit`` (hand a command to the loop; a future of its result) and ``shutdown``. The loop hands
    updates back through ``_deliver``.
    """

    tokenizer: ChatTokenizer
    max_model_len: int

    def __init__(self, name: str) -> None:
        self.name = name
        self._streams: dict[str, _Stream] = {}
        self._ids = itertools.count()
        self._closed = False

    @property
    @abc.abstractmethod
    def alive(self) -> bool:
        """The step loop runs (readiness: a dead engine makes the API process not ready)."""

    @property
    def exitcode(self) -> int | None:
        """How the engine's process ended (negative: the signal that killed it); None while it runs, or in-process."""
        return None

    def wait_ready(self, timeout: float | None = None) -> None:
        """Block until the engine can take requests (a loop in this process is ready once constructed)."""
        return

    @abc.abstractmethod
    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        """A prompt's token ids, checked as the engine would (ValidationError otherwise)."""

    @abc.abstractmethod
    def snapshot(self) -> EngineSnapshot: ...

    @abc.abstractmethod
    def shutdown(self, timeout: float = 10.0) -> None: ...

    @abc.abstractmethod
    def _submit(self, request: EngineCoreRequest) -> concurrent.futures.Future[Any]:
        """Hand ``request`` to the engine's loop; a future of its result."""

    def _call(self, request: EngineCoreRequest) -> Awaitable[Any]:
        """``_submit``, awaitable on the running event loop."""
        return asyncio.wrap_future(self._submit(request))

    # -- event-loop side ----------------------------------------------------------------------------------------
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
        prompt_ids = self.encode_prompt(prompt)
        arrival = time.monotonic()  # the hand-over: the wait for the engine's loop to take it counts as engine time
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._streams[rid] = stream
        finished = False
        try:
            await self._call(AddRequest(rid, prompt_ids, params, priority, cache_salt, arrival))
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
                self._submit(AbortRequest([rid]))

    async def abort(self, request_id: str) -> None:
        await self._call(AbortRequest([request_id]))

    async def metrics(self) -> dict[str, Any]:
        result: dict[str, Any] = await self._call(MetricsRequest())
        return result

    # -- loop side ----------------------------------------------------------------------------------------------
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

    def _fail_streams(self, exc: BaseException, request_ids: Iterable[str] | None = None) -> None:
        """Fail the given streams (default: all) with ``exc``."""
        ids = list(self._streams) if request_ids is None else request_ids
        for rid in ids:
            stream = self._streams.get(rid)
            if stream is not None:
                stream.put(exc)


def run_command(engine: LLMEngine, request: EngineCoreRequest) -> dict[str, Any] | None:
    """One request on the engine's own loop (``ShutdownRequest`` is the loop's to act on)."""
    match request:
        case AddRequest():
            engine.add(request)
        case AbortRequest():
            for request_id in request.request_ids:
                engine.abort_request(request_id)
        case StopSequences():
            engine.stop_sequences(request.sequences)
        case MetricsRequest():
            return engine.metrics()
        case ShutdownRequest():
            pass
        case _:
            raise TypeError(f"unknown engine request {type(request).__name__}")
    return None


class AsyncLLMEngine(EngineClient):
    """Wraps one ``LLMEngine`` whose step loop runs on a thread of this process; ``generate`` is safe to call
    from any number of coroutines."""

    def __init__(self, engine: LLMEngine, name: str = "engine") -> None:
        super().__init__(name)
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"tierline-{name}", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, config: EngineConfig, name: str | None = None) -> AsyncLLMEngine:
        from cloud.engine.llm_engine import LLMEngine

        return cls(LLMEngine(config), name or config.model_dir.name)

    @property
    def alive(self) -> bool:
        return not self._closed and self._thread.is_alive()

    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        return self.engine.encode_prompt(prompt)

    def snapshot(self) -> EngineSnapshot:
        return snapshot_of(self.engine)

    def _submit(self, request: EngineCoreRequest) -> concurrent.futures.Future[Any]:
        if self._closed:
            raise ServiceUnavailableError(f"engine {self.name} is shut down")
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()

        def run() -> None:
            try:
                fut.set_result(run_command(self.engine, request))
            except BaseException as exc:
                fut.set_exception(exc)

        self._commands.put(run)
        self._wake.set()
        return fut

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

    def _fail_all(self, exc: BaseException) -> None:
        self.engine.abort_all()
        self._fail_streams(exc)


def _put_all(items: list[tuple[asyncio.Queue[RequestOutput | BaseException], RequestOutput]]) -> None:
    for stream_queue, out in items:
        stream_queue.put_nowait(out)


async def generate_all(
    engine: EngineClient, prompts: list[str | list[int]], params: SamplingParams, rid: str, salt: str | None
) -> AsyncGenerator[tuple[int, RequestOutput], None]:
    """Updates of one engine request per prompt, interleaved as they come (one prompt: no task in between)."""
    if len(prompts) == 1:
        stream = engine.generate(prompts[0], params, request_id=f"{rid}-0", cache_salt=salt)
        try:
            async for out in stream:
                yield 0, out
        finally:
            await stream.aclose()
        return
    queue: asyncio.Queue[tuple[int, RequestOutput] | BaseException | None] = asyncio.Queue()

    async def pump(i: int, prompt: str | list[int]) -> None:
        try:
            async for out in engine.generate(prompt, params, request_id=f"{rid}-{i}", cache_salt=salt):
                await queue.put((i, out))
        except BaseException as exc:
            await queue.put(exc)
            return
        await queue.put(None)

    tasks = [asyncio.create_task(pump(i, p)) for i, p in enumerate(prompts)]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
