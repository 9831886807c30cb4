"""``EngineProcess``: an engine whose step loop runs in a process of its own (the API keeps its event loop).

Why: in one process the engine's step loop and the HTTP event loop share one interpreter lock, so under load
every request's parsing, auth and server-sent events wait for the engine's Python work and slow it down in turn.
With the loop in a child process (as vLLM's engine core and SGLang's scheduler run), the API process only
tokenizes, validates and frames events.

Protocol (pickled tuples, ``multiprocessing`` connection framing), one pipe each way:
  parent → child  ``(op, call_id, *args)``: ``add``, ``abort``, ``metrics`` (see ``run_command``); ``("stop",)``
  child → parent  ``("ready", info, error)`` once; ``("result", call_id, ok, value)`` per command with an id;
                  ``("out", updates, snapshot)`` per step; ``("fail", request_ids, message)`` when a step fails.
A step's updates are ``RequestOutput`` objects for a request's first and last update and, in between, plain tuples
of what changed (``_delta``), which the parent applies to the stream's previous update (``_apply``): pickling a
step's 64 dataclass updates cost ~200 µs in the child and ~120 µs to load in the parent, as tuples ~25 µs in all.
The parent reads its end without blocking, on the event loop (``loop.add_reader``), framing included.
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
import pickle
import signal
import struct
from collections.abc import Awaitable, Sequence
from multiprocessing.connection import Connection
from typing import Any

from cloud.engine.async_engine import EngineClient, EngineSnapshot, run_command, snapshot_of
from cloud.engine.config import EngineConfig
from cloud.engine.llm_engine import encode_prompt
from cloud.engine.outputs import CompletionOutput, RequestOutput, Usage
from cloud.engine.sequence import Logprob
from cloud.engine.tokenizer import ChatTokenizer
from shared.errors import ConfigurationError, ServiceUnavailableError

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 600.0  # loading a large model on a slow disk
DELIVER_SLICE = 8  # streams woken per pass of the event loop, after a step's first and last updates


class EngineProcess(EngineClient):
    """An ``EngineClient`` backed by a child process running the ``LLMEngine``.

    The constructor starts the child; ``wait_ready`` blocks until the model is loaded (several engines can load
    in parallel: construct them all, then wait for each). Updates are read on the event loop that uses the engine
    (``loop.add_reader`` on the pipe): no reader thread, so no hand-over of the interpreter lock per message —
    with a thread, messages queued behind the busy event loop and the last token of one request in ten reached
    the API ~90 ms after the engine produced it.
    """

    def __init__(self, config: EngineConfig, name: str | None = None, log_level: str = "INFO") -> None:
        super().__init__(name or config.model_dir.name)
        self.tokenizer = ChatTokenizer(config.model_dir)  # before the child: a missing model fails here, at once
        ctx = multiprocessing.get_context("spawn")  # never fork a process that runs threads and torch
        commands_in, self._commands = ctx.Pipe(duplex=False)
        self._updates, updates_out = ctx.Pipe(duplex=False)
        self._process = ctx.Process(
            target=_child_main,
            args=(config, commands_in, updates_out, self.name, log_level),
            name=f"tierline-engine-{self.name}",
            daemon=True,
        )
        self._process.start()
        self.pid: int = self._process.pid or 0
        commands_in.close()
        updates_out.close()
        self._buffer = bytearray()
        self._backlog: collections.deque[RequestOutput | _Delta] = collections.deque()  # updates still to deliver
        self._slicing = False  # a ``_deliver_slice`` is scheduled
        self._calls = itertools.count()
        self._pending: dict[int, asyncio.Future[Any] | concurrent.futures.Future[Any]] = {}
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
            _, info, error = self._updates.recv()
        except (EOFError, OSError):
            error = ConfigurationError(f"engine {self.name} exited while loading (code {self._process.exitcode})")
        if error is not None:
            self.shutdown(timeout=5)
            raise error
        self.max_model_len = int(info["max_model_len"])
        self._vocab_size = int(info["vocab_size"])
        self._ready = True

    @property
    def alive(self) -> bool:
        return not self._closed and self._process.is_alive()

    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        return encode_prompt(self.tokenizer, self._vocab_size, prompt)

    def snapshot(self) -> EngineSnapshot:
        """As of the child's last step (each step's update carries one)."""
        return self._snapshot

    def _submit(self, op: str, *args: Any) -> concurrent.futures.Future[Any]:
        self._attach()
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._send(op, fut, args)
        return fut

    def _call(self, op: str, *args: Any) -> Awaitable[Any]:
        """On the loop that reads the pipe: an asyncio future the reader resolves in place (~1.4 µs), not a thread's
        future handed over through the loop's self-pipe (~9.4 µs and one more wake-up of the loop per request)."""
        self._attach()
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            return super()._call(op, *args)
        fut: asyncio.Future[Any] = loop.create_future()
        self._send(op, fut, args)
        return fut

    def _send(self, op: str, fut: asyncio.Future[Any] | concurrent.futures.Future[Any], args: tuple[Any, ...]) -> None:
        call_id = next(self._calls)
        self._pending[call_id] = fut
        try:
            self._commands.send((op, call_id, *args))
        except (OSError, ValueError):
            self._pending.pop(call_id, None)
            raise ServiceUnavailableError(f"engine {self.name} is not running") from None

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
            self._commands.send(("stop",))
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
                kind = msg[0]
                if kind == "out":
                    self._snapshot = msg[2]
                    self._deliver_here(msg[1])
                elif kind == "result":
                    fut = self._pending.pop(msg[1], None)
                    if fut is not None and not fut.done():
                        if msg[2]:
                            fut.set_result(msg[3])
                        else:
                            fut.set_exception(msg[3])
                elif kind == "fail":
                    self._flush_backlog()  # the updates the child sent before the failure go first
                    self._fail_streams(ServiceUnavailableError(msg[2]), msg[1])
        except (EOFError, OSError):
            if not self._closed:
                logger.exception("engine %s process exited; failing the requests in flight", self.name)
                self._closed = True
            self._gone(ServiceUnavailableError(f"engine {self.name} process exited"))

    def _read_messages(self) -> list[Any]:
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
            messages.append(pickle.loads(buf[start : start + size]))  # noqa: S301 (our own child, our own pipe)
            at = start + size
        del buf[:at]
        return messages

    def _deliver_here(self, updates: list[RequestOutput | _Delta]) -> None:
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
        urgent = [u for u in updates if isinstance(u, RequestOutput)]  # whole: a first or last update (``_delta``)
        urgent.sort(key=_unfinished)  # finished first: their clients can send their next request sooner
        self._deliver_now(urgent)
        if len(urgent) < len(updates):
            self._backlog.extend(u for u in updates if not isinstance(u, RequestOutput))
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

    def _deliver_now(self, updates: Sequence[RequestOutput | _Delta]) -> None:
        """Straight into the queues of streams on this loop; other loops' streams through ``_deliver``."""
        elsewhere = []
        for update in updates:
            stream = self._streams.get(update.request_id if isinstance(update, RequestOutput) else update[0])
            if stream is None:
                continue
            out = update if isinstance(update, RequestOutput) else _apply(stream.last, update)
            stream.last = out
            if stream.loop is self._loop:
                stream.queue.put_nowait(out)
            else:
                elsewhere.append(out)
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
        self._backlog.clear()  # the streams fail: their exception ends them
        self._fail_streams(exc)
        self._detach_and_close()


def _fail(fut: asyncio.Future[Any], exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)


# (request_id, prompt_tokens, completion_tokens, cached_tokens, ttft_s, choices); a choice:
# (index, text, delta_text, delta_token_ids, delta_logprobs, finish_reason, num_spec_proposed, num_spec_accepted)
_Choice = tuple[int, str, str, list[int], list[Logprob], str | None, int, int]
_Delta = tuple[str, int, int, int, float | None, tuple[_Choice, ...]]


def _delta(out: RequestOutput) -> RequestOutput | _Delta:
    """A step's update as it crosses the pipe: whole when it is the request's first (all of its tokens are new:
    the parent has nothing to apply a change to) or last (it carries the final usage and the engine's latency),
    else only what changed. The cumulative text goes whole: held-back characters (a possible stop string, a split
    UTF-8 character) make it more than the previous text plus the delta."""
    if out.finished or all(len(c.token_ids) == len(c.delta_token_ids) for c in out.outputs):
        return out
    u = out.usage
    return (
        out.request_id,
        u.prompt_tokens,
        u.completion_tokens,
        u.cached_tokens,
        out.ttft_s,
        tuple(
            (
                c.index,
                c.text,
                c.delta_text,
                c.delta_token_ids,
                c.delta_logprobs,
                c.finish_reason,
                c.num_spec_proposed,
                c.num_spec_accepted,
            )
            for c in out.outputs
        ),
    )


def _apply(last: RequestOutput | None, delta: _Delta) -> RequestOutput:
    """The update ``delta`` describes, from the stream's previous update ``last`` (a fresh object: a consumer may
    still hold ``last``)."""
    request_id, prompt_tokens, completion_tokens, cached_tokens, ttft_s, choices = delta
    before = {c.index: c for c in last.outputs} if last is not None else {}
    outputs = []
    for index, text, delta_text, delta_ids, delta_logprobs, finish_reason, proposed, accepted in choices:
        prev = before.get(index)
        token_ids = prev.token_ids + delta_ids if prev is not None else list(delta_ids)
        logprobs = prev.logprobs + delta_logprobs if prev is not None and prev.logprobs is not None else None
        choice = CompletionOutput(index, text, token_ids, logprobs, finish_reason, delta_text, delta_ids)
        choice.delta_logprobs, choice.num_spec_proposed, choice.num_spec_accepted = delta_logprobs, proposed, accepted
        outputs.append(choice)
    return RequestOutput(
        request_id,
        last.prompt_token_ids if last is not None else [],
        outputs,
        False,
        Usage(prompt_tokens, completion_tokens, cached_tokens),
        ttft_s,
    )


def _unfinished(update: RequestOutput | _Delta) -> bool:
    return not (isinstance(update, RequestOutput) and update.finished)


def _child_main(config: EngineConfig, commands: Connection, updates: Connection, name: str, log_level: str) -> None:
    """The child: load the engine, then commands and steps until told to stop or the parent is gone."""
    from cloud.engine.llm_engine import LLMEngine
    from shared.logs import configure

    # Ctrl-C reaches the whole process group, and systemd's SIGTERM the whole cgroup: the parent drains its streams
    # first and then stops us (or we see the pipe close when it is gone).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    configure(log_level, os.environ.get("TIERLINE_LOG_FORMAT", "text"))
    try:
        engine = LLMEngine(config)
    except BaseException as exc:  # sent whole: the parent raises it from wait_ready
        updates.send(("ready", None, exc))
        return
    gc.collect()
    gc.freeze()  # the model and libraries stay for the process's life: the collector need not walk them every pass
    updates.send(("ready", {"max_model_len": engine.max_model_len, "vocab_size": engine.model_config.vocab_size}, None))
    try:
        while True:
            busy = engine.has_unfinished_requests()
            if commands.poll(0 if busy else 1.0):
                while True:
                    msg = commands.recv()
                    if msg[0] == "stop":
                        return
                    op, call_id, *args = msg
                    try:
                        value, ok = run_command(engine, op, tuple(args)), True
                    except Exception as exc:
                        value, ok = exc, False
                    if call_id is not None:
                        updates.send(("result", call_id, ok, value))
                    if not commands.poll(0):
                        break
            if not engine.has_unfinished_requests():
                continue
            try:
                outputs = engine.step()
            except Exception as exc:
                logger.exception("engine %s step failed; failing the requests in flight", name)
                updates.send(("fail", engine.abort_all(), f"engine {name} failed: {type(exc).__name__}"))
                continue
            updates.send(("out", [_delta(out) for out in outputs], snapshot_of(engine)))
    except (EOFError, OSError):
        return  # the API process is gone
