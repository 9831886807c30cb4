"""``tierline engine serve``: the built-in engine as a standalone OpenAI-compatible model server.

No tenants, no database, no keys: a model server for one model, as vLLM's or SGLang's is, so a GPU node runs it
(or vLLM) and gateways (``tierline cloud serve`` with an ``openai`` backend, see ``cloud.serving.backends``) scale apart
from engines. Routes: ``/v1/models``, ``/v1/chat/completions`` and ``/v1/completions`` (server-sent events with
``stream: true``, ``usage`` on every answer and, with ``stream_options.include_usage``, a last usage chunk),
``/health`` (200 while the engine runs, else 503) and ``/metrics`` (Prometheus: the autoscaling signals under
vLLM's names too — ``vllm:num_requests_waiting``, ``vllm:num_requests_running``, ``vllm:kv_cache_usage_perc`` (and
its older name ``vllm:gpu_cache_usage_perc``), ``vllm:request_queue_time_seconds`` — labelled ``model_name`` as
vLLM's are, so one autoscaling rule serves both servers).

The engine is the one ``tierline cloud serve`` runs (``cloud.serving.engine_pool.start_engine``: a child process unless
``TIERLINE_CLOUD_ENGINE_PROCESS=false``), configured by the same ``TIERLINE_CLOUD_*`` engine settings; requests
use the cloud's schemas (``shared.openai_schema``) and sampling mapping, so an answer here equals the gateway's
for the same request. ``cache_salt`` (vLLM's field) salts the prefix cache as the gateway's tenant salt does.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import stat
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from litestar import Litestar, Request, Response, get, post
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from pydantic import Field

from cloud.engine.async_engine import EngineClient, generate_all
from cloud.engine.outputs import RequestOutput
from cloud.engine.prompts import check_context_length
from cloud.engine.sampling_params import SamplingParams
from cloud.serving.completions import CompletionService, completion_choice
from cloud.serving.engine_pool import engine_config, start_engine
from cloud.serving.responses import SSE_HEADERS
from cloud.settings import CloudSettings
from shared.architectures import support_for, unsupported_message
from shared.errors import AuthenticationError, ConfigurationError, NotFoundError, ServiceUnavailableError
from shared.http import EventStream
from shared.openai_responses import SSE_DONE, chat_logprob, completion_logprobs, sse
from shared.openai_schema import ChatCompletionRequest, CompletionRequest
from shared.service_app import create_service_app
from shared.tools import StreamParser, chat_prompt
from shared.tools import message as chat_message


class ServerChatRequest(ChatCompletionRequest):
    cache_salt: str | None = Field(None, min_length=1, max_length=256)


class ServerCompletionRequest(CompletionRequest):
    cache_salt: str | None = Field(None, min_length=1, max_length=256)


# Time in queue, seconds (vLLM's histogram has the same name; these buckets reach down to the millisecond).
QUEUE_TIME_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
# vLLM's names of the same gauges (label model_name): autoscalers and dashboards written for vLLM read these.
VLLM_GAUGES = (
    ("vllm:num_requests_waiting", "waiting", "Requests waiting in the engine's queue (queue depth)"),
    ("vllm:num_requests_running", "running", "Sequences being decoded"),
    ("vllm:kv_cache_usage_perc", "kv", "KV-cache usage, 0 to 1 (1: every block in use)"),
    ("vllm:gpu_cache_usage_perc", "kv", "KV-cache usage, 0 to 1 (vLLM's name before 0.10)"),
)


class _EngineCollector:
    """The engine's load as gauges, read at scrape time."""

    def __init__(self, engine: EngineClient, model: str) -> None:
        self.engine = engine
        self.model = model

    def collect(self) -> Iterator[GaugeMetricFamily]:
        snap = self.engine.snapshot()
        values = {"waiting": snap.waiting, "running": snap.running, "kv": snap.kv_usage}
        for name, doc, value in (
            ("tierline_engine_waiting_sequences", "Requests queued in the engine (queue depth)", snap.waiting),
            ("tierline_engine_running_sequences", "Sequences being decoded", snap.running),
            ("tierline_engine_kv_cache_usage_ratio", "Share of KV blocks in use", snap.kv_usage),
            ("tierline_engine_up", "1 while the engine's step loop runs", 1.0 if self.engine.alive else 0.0),
        ):
            family = GaugeMetricFamily(name, doc, labels=["model"])
            family.add_metric([self.model], float(value))
            yield family
        for name, key, doc in VLLM_GAUGES:
            family = GaugeMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([self.model], float(values[key]))
            yield family


@dataclass(slots=True)
class ServerMetrics:
    model: str
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)
    requests: Counter = field(init=False)
    prompt_tokens: Counter = field(init=False)
    generated_tokens: Counter = field(init=False)
    queue_time: Histogram = field(init=False)

    def __post_init__(self) -> None:
        self.requests = Counter(
            "tierline_engine_requests", "Requests answered, by status", ["model", "status"], registry=self.registry
        )
        self.prompt_tokens = Counter(
            "tierline_engine_prompt_tokens", "Prompt tokens processed", ["model"], registry=self.registry
        )
        self.generated_tokens = Counter(
            "tierline_engine_generated_tokens",
            "Tokens generated (rate() of it: tokens/s)",
            ["model"],
            registry=self.registry,
        )
        self.queue_time = Histogram(
            "vllm:request_queue_time_seconds",
            "Time a request waited in the engine's queue before it was first scheduled",
            ["model_name"],
            buckets=QUEUE_TIME_BUCKETS,
            registry=self.registry,
        )

    def record(self, status: str, prompt: int, completion: int) -> None:
        self.requests.labels(self.model, status).inc()
        self.prompt_tokens.labels(self.model).inc(prompt)
        self.generated_tokens.labels(self.model).inc(completion)


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineServerState:
    engine: EngineClient
    model_name: str
    created: int
    server_metrics: ServerMetrics
    request_timeout_s: float


@dataclass(slots=True)
class _Counts:
    by_request: dict[int, tuple[int, int, int]] = field(default_factory=dict)

    def update(self, i: int, out: RequestOutput, metrics: ServerMetrics) -> None:
        u = out.usage
        if i not in self.by_request and out.queue_s is not None:  # a prompt's first update: it left the queue
            metrics.queue_time.labels(metrics.model).observe(out.queue_s)
        self.by_request[i] = (u.prompt_tokens, u.completion_tokens, u.cached_tokens)

    def usage(self) -> dict[str, Any]:
        prompt = sum(v[0] for v in self.by_request.values())
        completion = sum(v[1] for v in self.by_request.values())
        cached = sum(v[2] for v in self.by_request.values())
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }


def _check_model(state: EngineServerState, model: str) -> None:
    if model != state.model_name:
        raise NotFoundError(
            f"The model '{model}' does not exist (this server serves '{state.model_name}')",
            param="model",
            code="model_not_found",
        )


def _checked(engine: EngineClient, prompts: list[str | list[int]], max_tokens: int | None) -> list[str | list[int]]:
    """Every prompt's ids, each refused (400) before any starts when the engine would refuse it."""
    ids: list[str | list[int]] = []
    for prompt in prompts:
        prompt_ids = engine.encode_prompt(prompt)
        check_context_length(len(prompt_ids), max_tokens, engine.max_model_len)
        ids.append(prompt_ids)
    return ids


async def _run(
    state: EngineServerState,
    prompts: list[str | list[int]],
    params: SamplingParams,
    salt: str | None,
    base: dict[str, Any],
    prologue: list[dict[str, Any]],
    render: Callable[[int, RequestOutput], list[dict[str, Any]]],
    stream: bool,
    include_usage: bool,
    answer: Callable[[dict[int, RequestOutput], _Counts], dict[str, Any]],
) -> Response[Any]:
    engine, metrics = state.engine, state.server_metrics
    rid = base["id"]
    counts = _Counts()
    updates = generate_all(engine, prompts, params, rid, salt)
    if not stream:
        final: dict[int, RequestOutput] = {}
        status = "error"
        try:
            async with asyncio.timeout(state.request_timeout_s):
                async for i, out in updates:
                    counts.update(i, out, metrics)
                    if out.finished:
                        final[i] = out
            status = "ok"
        finally:
            u = counts.usage()
            metrics.record(status, u["prompt_tokens"], u["completion_tokens"])
        return Response(answer(final, counts))
    try:
        first = await anext(updates)  # admission errors (queue full, ...) are a status code, not an event
    except BaseException:
        await updates.aclose()
        metrics.record("error", 0, 0)
        raise

    async def body() -> AsyncIterator[bytes]:
        status = "abandoned"
        try:
            async with asyncio.timeout(state.request_timeout_s):
                events = [sse({**base, "choices": [choice]}) for choice in prologue]
                item: tuple[int, RequestOutput] | None = first
                while item is not None:
                    i, out = item
                    counts.update(i, out, metrics)
                    events.extend(sse({**base, "choices": [choice]}) for choice in render(i, out))
                    if events:
                        yield b"".join(events)
                        events.clear()
                    item = await anext(updates, None)
                if include_usage:
                    events.append(sse({**base, "choices": [], "usage": counts.usage()}))
                events.append(SSE_DONE)
                status = "ok"
                yield b"".join(events)
        except TimeoutError:
            status = "deadline"
            yield sse(
                {"error": {"message": "the request ran past its deadline", "type": "server_error", "code": "timeout"}}
            )
        except ServiceUnavailableError as exc:
            status = "error"
            yield sse(exc.to_openai())
        finally:
            await updates.aclose()
            u = counts.usage()
            metrics.record(status, u["prompt_tokens"], u["completion_tokens"])

    return EventStream(body(), media_type="text/event-stream", headers=SSE_HEADERS)


@post("/v1/chat/completions", status_code=200)
async def chat_completions(
    engine: EngineClient, data: ServerChatRequest, engine_server: EngineServerState
) -> Response[Any]:
    state = engine_server
    _check_model(state, data.model)
    params = CompletionService._params(engine.tokenizer, data, data.max_new_tokens, data.num_logprobs)
    text = chat_prompt(data, engine.tokenizer)
    prompts = _checked(engine, [text], params.max_tokens)
    tok = engine.tokenizer
    base: dict[str, Any] = {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": state.model_name,
    }
    parsers = {i: StreamParser() for i in range(data.n)} if data.calls_tools else None
    opening = {"role": "assistant"} if parsers is not None else {"role": "assistant", "content": ""}
    prologue = [{"index": i, "delta": opening, "finish_reason": None} for i in range(data.n)]

    def render(_: int, out: RequestOutput) -> list[dict[str, Any]]:
        chunks = []
        for c in out.outputs:
            if not (c.delta_text or c.finish_reason or c.delta_logprobs):
                continue
            if parsers is not None:  # tool calls: deltas of content or of tool_calls (shared.tools)
                calls = parsers[c.index].chunks(c.index, c.delta_text, c.finish_reason if out.finished else None)
                if params.logprobs is not None and c.delta_logprobs:
                    calls = calls or [{"index": c.index, "delta": {}, "finish_reason": None}]
                    calls[0]["logprobs"] = {"content": [chat_logprob(tok, lp) for lp in c.delta_logprobs]}
                chunks.extend(calls)
                continue
            chunk: dict[str, Any] = {"index": c.index, "delta": {}, "finish_reason": None}
            if c.delta_text:
                chunk["delta"]["content"] = c.delta_text
            if params.logprobs is not None:
                chunk["logprobs"] = {"content": [chat_logprob(tok, lp) for lp in c.delta_logprobs]}
            if c.finish_reason and out.finished:
                chunk["finish_reason"] = c.finish_reason
            chunks.append(chunk)
        return chunks

    def answer(final: dict[int, RequestOutput], counts: _Counts) -> dict[str, Any]:
        choices = []
        for c in final[0].outputs:
            message, finish_reason = (
                chat_message(c.text, c.finish_reason)
                if data.calls_tools
                else ({"role": "assistant", "content": c.text}, c.finish_reason)
            )
            logprobs = {"content": [chat_logprob(tok, lp) for lp in c.logprobs]} if c.logprobs is not None else None
            choices.append({"index": c.index, "message": message, "finish_reason": finish_reason, "logprobs": logprobs})
        return {**base, "object": "chat.completion", "choices": choices, "usage": counts.usage()}

    return await _run(
        state, prompts, params, data.cache_salt, base, prologue, render, data.stream, data.include_usage, answer
    )


@post("/v1/completions", status_code=200)
async def completions(
    engine: EngineClient, data: ServerCompletionRequest, engine_server: EngineServerState
) -> Response[Any]:
    state = engine_server
    _check_model(state, data.model)
    params = CompletionService._params(engine.tokenizer, data, data.max_tokens, data.logprobs)
    prompts = _checked(engine, data.prompts(), params.max_tokens)
    tok = engine.tokenizer
    base: dict[str, Any] = {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": state.model_name,
    }

    def render(i: int, out: RequestOutput) -> list[dict[str, Any]]:
        return [
            {
                "index": i * params.n + c.index,
                "text": c.delta_text,
                "finish_reason": c.finish_reason if out.finished else None,
                "logprobs": completion_logprobs(tok, c.delta_logprobs) if params.logprobs is not None else None,
            }
            for c in out.outputs
            if c.delta_text or c.finish_reason
        ]

    def answer(final: dict[int, RequestOutput], counts: _Counts) -> dict[str, Any]:
        choices = [
            completion_choice(tok, data, i * params.n + c.index, final[i], c)
            for i in range(len(prompts))
            for c in final[i].outputs
        ]
        return {**base, "choices": choices, "usage": counts.usage()}

    return await _run(
        state, prompts, params, data.cache_salt, base, [], render, data.stream, data.include_usage, answer
    )


@get("/v1/models", sync_to_thread=False)
def list_models(engine_server: EngineServerState) -> dict[str, Any]:
    state = engine_server
    model = {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "tierline"}
    return {"object": "list", "data": [model | {"max_model_len": state.engine.max_model_len}]}


@get("/health", sync_to_thread=False)
def health(engine: EngineClient) -> dict[str, str]:
    """200 while the engine's step loop runs; 503 once it is gone (a gateway's active probe reads this)."""
    if not engine.alive:
        raise ServiceUnavailableError(f"engine {engine.name} is not running")
    return {"status": "ok"}


@get("/metrics", sync_to_thread=False)
def render_metrics(server_metrics: ServerMetrics) -> Response[bytes]:
    return Response(generate_latest(server_metrics.registry), media_type="text/plain; version=0.0.4; charset=utf-8")


@dataclass(frozen=True, slots=True, kw_only=True)
class _State:
    """The app's state (a dependency per field): the engine, and what the routes share."""

    engine: EngineClient
    server_metrics: ServerMetrics
    engine_server: EngineServerState


def _key_guard(api_key: str | None) -> Callable[[Request[Any, Any, Any]], None]:
    """With a key: ``/v1/*`` needs ``Authorization: Bearer KEY`` (401 otherwise); ``/health`` and ``/metrics`` stay
    open, as a probe and a scraper have no key."""
    expected = api_key.encode() if api_key else None

    def check(request: Request[Any, Any, Any]) -> None:
        if expected is None or not request.url.path.startswith("/v1/"):
            return
        scheme, _, secret = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(secret.strip().encode(), expected):
            raise AuthenticationError("missing or wrong API key (Authorization: Bearer ...)")

    return check


def read_key_file(path: Path) -> str:
    """The server's API key from ``path``: a file only its owner can read (mode 0600 or stricter)."""
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigurationError(f"{path} is readable by others (mode {mode:o}); chmod 600 it")
    key = path.read_text().strip()
    if not key:
        raise ConfigurationError(f"{path} is empty")
    return key


def load_engine(model_dir: Path, settings: CloudSettings | None = None) -> EngineClient:
    """Start the engine for ``model_dir`` and wait until it has loaded: a checkpoint it cannot serve is a
    ConfigurationError naming why (an architecture outside ``shared.architectures``' engine column first, before
    anything loads)."""
    settings = settings or CloudSettings()
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ConfigurationError(f"{model_dir}/config.json is unreadable: {exc}") from None
    if not isinstance(config, dict) or not support_for(config).engine:
        raise ConfigurationError(f"{model_dir}: {unsupported_message(config if isinstance(config, dict) else {})}")
    engine = start_engine(engine_config(model_dir, settings), model_dir.name, settings)
    try:
        engine.wait_ready()
    except BaseException:
        engine.shutdown()
        raise
    return engine


def create_engine_app(
    model_dir: Path,
    model_name: str | None = None,
    settings: CloudSettings | None = None,
    api_key: str | None = None,
    engine: EngineClient | None = None,
) -> Litestar:
    """The server's app; the engine starts (and loads) in the app's start-up, unless ``engine`` (loaded already,
    e.g. by :func:`load_engine`) is given, and stops at its shutdown."""
    settings = settings or CloudSettings()
    name = model_name or model_dir.name
    config = engine_config(model_dir, settings)
    loaded = engine

    @asynccontextmanager
    async def start() -> AsyncIterator[_State]:
        engine = loaded or start_engine(config, model_dir.name, settings)
        try:
            await asyncio.to_thread(engine.wait_ready)
            metrics = ServerMetrics(name)
            metrics.registry.register(_EngineCollector(engine, name))
            state = EngineServerState(
                engine=engine,
                model_name=name,
                created=int(time.time()),
                server_metrics=metrics,
                request_timeout_s=settings.request_timeout_s,
            )
            yield _State(engine=engine, server_metrics=metrics, engine_server=state)
        finally:
            engine.shutdown()

    return create_service_app(
        route_handlers=[chat_completions, completions, list_models, health, render_metrics],
        start=start,
        state_type=_State,
        request_max_body_size=settings.max_body_bytes,
        before_request=_key_guard(api_key),
        signature_namespace={"EngineClient": EngineClient, "EngineServerState": EngineServerState},
    )
