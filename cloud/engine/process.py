"""``EngineProcess``: an engine whose step loop runs in a process of its own (the API keeps its event loop).

Why: in one process the engine's step loop and the HTTP event loop share one interpreter lock, so under load
every request's parsing, auth and server-sent events wait for the engine's Python work and slow it down in turn.
With the loop in a child process (as vLLM's engine core and SGLang's scheduler run), the child does the model's
work only and the API process tokenizes, validates, detokenises (``OutputProcessor``) and frames events.

Protocol: the typed structs of ``cloud.engine.protocol``, msgpack-encoded, in ``multiprocessing`` connection framing,
one pipe each way. Parent → child: ``EngineCoreRequest`` (add, abort, stop sequences, metrics, shutdown); child →
parent: ``Ready`` once, a ``CallResult`` per request with a ``call_id``, ``EngineCoreOutputs`` per step (token ids,
with a load snapshot), ``StepFailed`` when a step fails. Shipping a step of 64 decoding streams (build, encode,
decode) as these structs took ~1.2-1.4 ms against ~4.1 ms for the pickled text-delta tuples sent before (their
``_delta``/``_apply`` included), 2.4 KB against 4.5 KB, measured side by side on a host loaded ~7x over its 2 cores;
pickled dataclasses cost more than either.
The parent reads its end without blocking, on the event loop (``loop.add_reader``), framing included. A stop
string found by the parent ends its sequence there at once and is sent to the child as ``StopSequences``; until the
child confirms that (or an abort), progress it still sends for the request is dropped, so a request id used again
right away never receives its predecessor's tokens.
The child leaves when told to stop or when the pipe closes (the API process is gone); the parent fails every
open stream with ``ServiceUnavailableError`` when the child is gone. Times (``arrival``) are ``time.monotonic``,
one clock for every process on the host.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import gc
import itertools
import logging
import multiprocessing
import os
import signal
import struct
from collections.abc import Awaitable, Sequence
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

import msgspec

from cloud.engine.async_engine import EngineClient, EngineSnapshot, run_command, snapshot_of
from cloud.engine.config import EngineConfig
from cloud.engine.output_processor import OutputProcessor
from cloud.engine.outputs import RequestOutput
from cloud.engine.prompts import encode_prompt
from cloud.engine.protocol import (
    AbortRequest,
    AddRequest,
    CallResult,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreResponse,
    ErrorInfo,
    Ready,
    RequestCodec,
    ResponseCodec,
    ShutdownRequest,
    StepFailed,
    StopSequences,
    error_from,
    error_info,
)
from cloud.engine.tokenizer import ChatTokenizer
from shared.errors import ConfigurationError, ServiceUnavailableError

if TYPE_CHECKING:
    from cloud.engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 600.0  # loading a large model on a slow disk
DELIVER_SLICE = 8  # streams woken per pass of the event loop, after a step's first and last updates


class EngineProcess(EngineClient):
    """An ``EngineClient`` backed by a child process running the ``LLMEngine``'s core.

    The constructor starts the child; ``wait_ready`` blocks until the model is loaded (several engines can load
    in parallel: construct them all, then wait for each). Updates are read on the event loop that uses the engine
    (``loop.add_reader`` on the pipe): no reader thread, so no hand-over of the interpreter lock per message —
    with a thread, messages queued behind the busy event loop and the last token of one request in ten reached
    the API ~90 ms after the engine produced it.
    """

    def __init__(self, config: EngineConfig, name: str | None = None, log_level: str = "INFO") -> None:
        super().__init__(name or config.model_dir.name)
        self.tokenizer = ChatTokenizer(config.model_dir)  # before the child: a missing model fails here, at once
        self._processor = OutputProcessor(self.tokenizer, config.stream_interval)
        self._requests = RequestCodec()
        self._responses = ResponseCodec()
        ctx = _start_context()
        log_format = os.environ.get("TIERLINE_LOG_FORMAT", "text")  # the fork server's environment is from its start
        commands_in, self._commands = ctx.Pipe(duplex=False)
        self._updates, updates_out = ctx.Pipe(duplex=False)
        self._process = ctx.Process(
            target=_child_main,
            args=(config, commands_in, updates_out, self.name, log_level, log_format),
            name=f"tierline-engine-{self.name}",
            daemon=True,
        )
        self._process.start()
        self.pid: int = self._process.pid or 0
        commands_in.close()
        updates_out.close()
        self._buffer = bytearray()
        self._backlog: collections.deque[RequestOutput] = collections.deque()  # updates still to deliver
        self._slicing = False  # a ``_deliver_slice`` is scheduled
        self._calls = itertools.count()
        self._pending: dict[int, asyncio.Future[Any] | concurrent.futures.Future[Any]] = {}
        # Request ids ended here (abort, stop string) until the child confirms it: progress it sent before is stale.
        self._draining: collections.Counter[str] = collections.Counter()
        self._drain_calls: dict[int, list[str]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._snapshot = EngineSnapshot()
        self._vocab_size = 0
        self._ready = False

    @classmethod
    def from_config(cls, config: EngineConfig, name: str | None = None, log_level: str = "INFO") -> EngineProcess:
        engine = cls(config, name, log_level)
        engine.wait_ready()
        return engine

    def wait_ready(self, timeout: float | None = START_TIMEOUT_S) -> None:
        """Block until the child has loaded the model; raise what stopped it (the child is gone then)."""
        if self._ready:
            return
        try:
            if not self._updates.poll(timeout):
                raise ConfigurationError(f"engine {self.name} did not load in {timeout:.0f}s")
            ready = self._responses.decode(self._updates.recv_bytes())
        except (EOFError, OSError):
            ready = Ready(
                error=ErrorInfo(
                    "ConfigurationError", f"engine {self.name} exited while loading (code {self._process.exitcode})"
                )
            )
        if not isinstance(ready, Ready):
            ready = Ready(error=ErrorInfo("ConfigurationError", f"engine {self.name} sent {type(ready).__name__}"))
        if ready.error is not None:
            self.shutdown(timeout=5)
            raise error_from(ready.error)
        self.max_model_len = ready.max_model_len
        self._vocab_size = ready.vocab_size
        self._ready = True

    @property
    def alive(self) -> bool:
        return not self._closed and self._process.is_alive()

    @property
    def exitcode(self) -> int | None:
        return self._process.exitcode

    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        return encode_prompt(self.tokenizer, self._vocab_size, prompt)

    def snapshot(self) -> EngineSnapshot:
        """As of the child's last step (each step's update carries one)."""
        return self._snapshot

    def _submit(self, request: EngineCoreRequest) -> concurrent.futures.Future[Any]:
        self._attach()
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._send(request, fut)
        return fut

    def _call(self, request: EngineCoreRequest) -> Awaitable[Any]:
        """On the loop that reads the pipe: an asyncio future the reader resolves in place (~1.4 µs), not a thread's
        future handed over through the loop's self-pipe (~9.4 µs and one more wake-up of the loop per request)."""
        self._attach()
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            return super()._call(request)
        fut: asyncio.Future[Any] = loop.create_future()
        self._send(request, fut)
        return fut

    def _send(
        self, request: EngineCoreRequest, fut: asyncio.Future[Any] | concurrent.futures.Future[Any] | None
    ) -> None:
        """Send ``request`` (with a call id when ``fut`` waits for its result), keeping the output processor's
        requests in step with the child's."""
        if fut is not None:
            request.call_id = next(self._calls)
            self._pending[request.call_id] = fut
        if isinstance(request, AddRequest):
            self._processor.add_request(request)  # before the child can send progress for it
        elif isinstance(request, AbortRequest):
            for request_id in request.request_ids:
                self._processor.abort_request(request_id)
            self._drain(request.request_ids, request)
        elif isinstance(request, StopSequences):
            self._drain([rid for rid, _ in request.sequences if not self._processor.has_request(rid)], request)
        try:
            self._commands.send_bytes(self._requests.encode(request))
        except (OSError, ValueError):
            if request.call_id is not None:
                self._pending.pop(request.call_id, None)
            if isinstance(request, AddRequest):
                self._processor.abort_request(request.request_id)
            raise ServiceUnavailableError(f"engine {self.name} is not running") from None

    def _drain(self, request_ids: list[str], request: AbortRequest | StopSequences) -> None:
        if request.call_id is None:
            request.call_id = next(self._calls)
        self._draining.update(request_ids)
        self._drain_calls[request.call_id] = request_ids

    def _attach(self) -> None:
        """Read the pipe on the running event loop (once; again on a new loop when the old one has stopped)."""
        if self._closed:
            raise ServiceUnavailableError(f"engine {self.name} is shut down")
        loop = asyncio.get_running_loop()
        if self._loop is loop or (self._loop is not None and self._loop.is_running()):
            return
        self._loop = loop
        self._slicing = False  # one scheduled on a loop that has stopped never runs
        os.set_blocking(self._updates.fileno(), False)
        loop.add_reader(self._updates.fileno(), self._on_readable)

    def _detach_and_close(self) -> None:
        """Stop reading the updates pipe and close both pipes — on the reading loop's thread when it runs
        elsewhere, so that the descriptor is never closed (and its number reused) while that loop still polls it."""
        loop, self._loop = self._loop, None
        if loop is not None and not loop.is_closed() and loop.is_running():
            try:
                running = asyncio.get_running_loop()
            except RuntimeError:
                running = None
            if running is not loop:
                loop.call_soon_threadsafe(self._remove_and_close, loop)
                return
        self._remove_and_close(loop)

    def _remove_and_close(self, loop: asyncio.AbstractEventLoop | None) -> None:
        if loop is not None and not loop.is_closed() and not self._updates.closed:
            loop.remove_reader(self._updates.fileno())
        self._commands.close()
        self._updates.close()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the child; requests still in flight get ServiceUnavailableError."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(OSError, ValueError):
            self._commands.send_bytes(self._requests.encode(ShutdownRequest()))
        self._process.join(timeout)
        if self._process.is_alive():
            logger.warning("engine %s did not stop in %.0fs; killing it", self.name, timeout)
            self._process.kill()
            self._process.join(5)
        self._gone(ServiceUnavailableError(f"engine {self.name} is shut down"))

    # -- event-loop side: the child's messages --------------------------------------------------------------------
    def _on_readable(self) -> None:
        try:
            for msg in self._read_messages():
                self._handle(msg)
        except (EOFError, OSError):
            if not self._closed:
                logger.exception("engine %s process exited; failing the requests in flight", self.name)
                self._closed = True
            self._gone(ServiceUnavailableError(f"engine {self.name} process exited"))
        except msgspec.MsgspecError:
            logger.exception("engine %s sent a message this process cannot read; stopping it", self.name)
            self.shutdown(timeout=5)

    def _handle(self, msg: EngineCoreResponse) -> None:
        match msg:
            case EngineCoreOutputs():
                self._snapshot = msg.snapshot or self._snapshot
                self._on_outputs(msg)
            case CallResult():
                self._on_result(msg)
            case StepFailed():
                self._flush_backlog()  # the updates the child sent before the failure go first
                for request_id in msg.request_ids:
                    self._processor.abort_request(request_id)
                self._fail_streams(ServiceUnavailableError(msg.message), msg.request_ids)
            case _:
                raise msgspec.ValidationError(f"unexpected {type(msg).__name__} from the engine")

    def _on_outputs(self, msg: EngineCoreOutputs) -> None:
        if self._draining:
            msg.outputs = [o for o in msg.outputs if o.request_id not in self._draining]
        processed = self._processor.process(msg)
        if processed.stopped:
            with contextlib.suppress(ServiceUnavailableError):  # the child is gone: so is the sequence
                self._send(StopSequences(processed.stopped), None)
        self._deliver_here(processed.outputs)

    def _on_result(self, msg: CallResult) -> None:
        for request_id in self._drain_calls.pop(msg.call_id, ()):
            self._draining[request_id] -= 1
            if self._draining[request_id] <= 0:
                del self._draining[request_id]
        fut = self._pending.pop(msg.call_id, None)
        if fut is None or fut.done():
            return
        if msg.error is not None:
            fut.set_exception(error_from(msg.error))
        else:
            fut.set_result(msg.value)

    def _read_messages(self) -> list[EngineCoreResponse]:
        """Every whole message readable now (the pipe is non-blocking); EOFError once the child is gone."""
        fd = self._updates.fileno()
        while True:
            try:
                data = os.read(fd, 1 << 20)
            except BlockingIOError:
                break
            if not data:
                raise EOFError
            self._buffer += data
            if len(data) < 1 << 20:
                break
        messages, buf, at = [], self._buffer, 0
        while len(buf) - at >= 4:
            (size,) = struct.unpack_from("!i", buf, at)
            start = at + 4
            if size == -1:  # a frame over 2 GiB: 8 more bytes of length
                if len(buf) - start < 8:
                    break
                (size,) = struct.unpack_from("!Q", buf, start)
                start += 8
            if len(buf) - start < size:
                break
            messages.append(self._responses.decode(buf[start : start + size]))
            at = start + size
        del buf[:at]
        return messages

    def _deliver_here(self, updates: list[RequestOutput]) -> None:
        """A step's updates: a request's first update (its first token) and last (its answer is complete) at once,
        the others in slices of ``DELIVER_SLICE`` streams, one slice per pass of the event loop.

        Each delivered update wakes its stream's task, which writes an event to its socket: ~64 writes a step at 64
        streams. Woken all at once, they all ran before the loop next read its sockets, so a new request (most
        arrive just then: a finished stream's client sends its next one as soon as it has its answer) waited for
        every one of them before its handler ran. Between slices the loop reads its sockets and runs new requests'
        handlers. Traced on ``bench api --preset tiny`` (2 cores), a request's wait from its client's send to its
        handler was 4.5-6.2 ms p50 in three runs without slices and 3.2-3.9 ms in four with. A middle update that
        waits for a slice delays no request's end: last updates are never held back.
        """
        self._flush_backlog()  # the previous step's slices first: a stream's updates stay in order
        urgent = [u for u in updates if _is_urgent(u)]
        urgent.sort(key=_unfinished)  # finished first: their clients can send their next request sooner
        self._deliver_now(urgent)
        if len(urgent) < len(updates):
            self._backlog.extend(u for u in updates if not _is_urgent(u))
            if not self._slicing and self._loop is not None:
                self._slicing = True
                self._loop.call_soon(self._deliver_slice)

    def _deliver_slice(self) -> None:
        backlog, loop = self._backlog, self._loop
        if backlog:
            self._deliver_now([backlog.popleft() for _ in range(min(DELIVER_SLICE, len(backlog)))])
        self._slicing = bool(backlog) and loop is not None
        if backlog and loop is not None:
            loop.call_soon(self._deliver_slice)

    def _flush_backlog(self) -> None:
        if self._backlog:
            backlog, self._backlog = self._backlog, collections.deque()
            self._deliver_now(backlog)

    def _deliver_now(self, updates: Sequence[RequestOutput]) -> None:
        """Straight into the queues of streams on this loop; other loops' streams through ``_deliver``."""
        elsewhere = []
        for update in updates:
            stream = self._streams.get(update.request_id)
            if stream is None:
                continue
            if stream.loop is self._loop:
                stream.queue.put_nowait(update)
            else:
                elsewhere.append(update)
        if elsewhere:
            self._deliver(elsewhere)

    def _gone(self, exc: ServiceUnavailableError) -> None:
        """The child is gone: fail what waits on it, stop reading, close the pipes."""
        for fut in list(self._pending.values()):
            if isinstance(fut, asyncio.Future):  # its loop's own: set there (this may be another thread)
                with contextlib.suppress(RuntimeError):  # that loop is closed: nobody waits any more
                    fut.get_loop().call_soon_threadsafe(_fail, fut, exc)
            elif not fut.done():
                fut.set_exception(exc)
        self._pending.clear()
        self._drain_calls.clear()
        self._draining.clear()
        self._backlog.clear()  # the streams fail: their exception ends them
        self._fail_streams(exc)
        self._detach_and_close()


def _fail(fut: asyncio.Future[Any], exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)


def _is_urgent(update: RequestOutput) -> bool:
    """A request's first update (every token in it is new) or its last."""
    return update.finished or all(len(c.token_ids) == len(c.delta_token_ids) for c in update.outputs)


def _unfinished(update: RequestOutput) -> bool:
    return not update.finished


_ENGINE_MODULE = "cloud.engine.llm_engine"  # what the fork server imports before it forks


def _start_context() -> multiprocessing.context.ForkServerContext | multiprocessing.context.SpawnContext:
    """How engine children start: forked from a fork server that has imported the engine's code (torch, the model,
    the kernels) once, so a child costs a fork instead of an interpreter and ~1.5 s of imports (one engine per served
    LM at start, and again for each restart of one that died). Never a fork of the API process itself, which runs
    threads; the fork server only imports (no torch thread pool yet, CUDA not initialised), so a fork of it is safe.
    ``spawn`` where the platform has no fork server."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([_ENGINE_MODULE, __name__])
    return ctx


def _child_main(
    config: EngineConfig, commands: Connection, updates: Connection, name: str, log_level: str, log_format: str
) -> None:
    """The child: load the engine's core, then requests and steps until told to stop or the parent is gone."""
    from cloud.engine.llm_engine import LLMEngine
    from shared.logs import configure

    # Ctrl-C reaches the whole process group, and systemd's SIGTERM the whole cgroup: the parent drains its streams
    # first and then stops us (or we see the pipe close when it is gone).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    configure(log_level, log_format)
    requests, responses = RequestCodec(), ResponseCodec()
    try:
        engine = LLMEngine(config, process_outputs=False)
    except BaseException as exc:  # the parent raises it from wait_ready
        updates.send_bytes(responses.encode(Ready(error=error_info(exc))))
        return
    gc.collect()
    gc.freeze()  # the model and libraries stay for the process's life: the collector need not walk them every pass
    updates.send_bytes(responses.encode(Ready(engine.max_model_len, engine.model_config.vocab_size)))
    try:
        while True:
            busy = engine.has_unfinished_requests()
            if commands.poll(0 if busy else 1.0) and not _run_requests(engine, commands, updates, requests, responses):
                return
            if not engine.has_unfinished_requests():
                continue
            try:
                outputs = engine.step_core()
            except Exception as exc:
                logger.exception("engine %s step failed; failing the requests in flight", name)
                failed = StepFailed(engine.abort_all(), f"engine {name} failed: {type(exc).__name__}")
                updates.send_bytes(responses.encode(failed))
                continue
            outputs.snapshot = snapshot_of(engine)
            updates.send_bytes(responses.encode(outputs))
    except (EOFError, OSError):
        return  # the API process is gone


def _run_requests(
    engine: LLMEngine, commands: Connection, updates: Connection, requests: RequestCodec, responses: ResponseCodec
) -> bool:
    """Every request waiting on the pipe; False when told to shut down. A message of a type this side does not
    know raises (``msgspec.ValidationError``): the child exits and the parent fails its streams."""
    while True:
        request = requests.decode(commands.recv_bytes())
        if isinstance(request, ShutdownRequest):
            return False
        try:
            result = CallResult(request.call_id or 0, run_command(engine, request))
        except Exception as exc:
            result = CallResult(request.call_id or 0, error=error_info(exc))
        if request.call_id is not None:
            updates.send_bytes(responses.encode(result))
        if not commands.poll(0):
            return True
