"""The gateway's side of a request to an ``openai`` backend: the same admission, limits, budget and metering as
the built-in engine, the generation done by an upstream OpenAI-compatible server.

- **Admission**: the prompt is counted with the model's tokenizer (``tokenizer`` in the backends file) and
  prompt + ``max_tokens`` (else the room left in the context) is reserved against the rate limits and the
  budget before any upstream call, exactly as for the built-in engine (``CompletionService.reserve``).
- **Billing**: settled from the upstream's ``usage``; streams always ask for it (``stream_options.include_usage``)
  and the client sees the usage chunk only when it asked. An upstream that sends no usage is counted here with the
  tokenizer (prompt, and the text it sent), and the usage record says so (``usage_source = "gateway"``). A stream
  cut mid-way is billed for what was relayed.
- **Errors**: an upstream 4xx passes through with its status and message in the OpenAI error shape; a connection
  error, timeout or 5xx ejects towards the endpoint's breaker and the request is retried on another endpoint as
  long as no byte reached the client (for a stream: until its first event is relayed); when none can take it:
  502 (upstream failed) or 503 (no healthy endpoint), both with ``Retry-After``. After the first byte, a failure
  ends the stream with an error event.
- **Prompt logprobs** (``echo`` with ``logprobs``, ``max_tokens: 0``, ``prompt_logprobs``) are forwarded; an
  upstream whose answer lacks them (the echoed prompt's tokens, first logprob ``null``; ``prompt_logprobs``) is a
  400 naming the field, billed nothing, never an answer with empty or generated-only lists.
- **Disconnects**: a client that leaves closes the upstream response, which aborts the upstream request.
- **Isolation**: ``cache_salt`` (vLLM's per-request prefix-cache salt) is the tenant's, as in the built-in engine.
- **Trust** (``make_remote``): a backends-file model is the operator's and is taken as written; a registry version's
  serving spec reads its key only from the operator's designated places and reaches only endpoints the egress
  policy allows, checked when its backend is built and at every resolution (``cloud.serving.backends.pool``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx
import msgspec

from cloud.engine.prompts import check_context_length
from cloud.serving.backends.config import context_length, load_backends
from cloud.serving.backends.http1 import UpstreamClient, UpstreamResponse, upstream_client
from cloud.serving.backends.pool import (
    BadGatewayError,
    Endpoint,
    PoolCollector,
    ReplicaPool,
    UpstreamUnavailableError,
    pinned_roots,
    resolve_roots,
)
from cloud.serving.completions import MAX_INLINE_PROMPT_BYTES, Caller, CompletionService, run_to_end
from cloud.serving.engine_pool import Metered
from controlplane.billing.pricing import Tokens
from shared.backend_spec import KeySources, UpstreamSpec
from shared.chat_tokenizer import ChatTokenizer
from shared.egress import EgressPolicy
from shared.errors import (
    ApplicationError,
    ConfigurationError,
    DeadlineExceededError,
    PermissionDeniedError,
    ValidationError,
)
from shared.openai_responses import SSE_DONE, sse
from shared.openai_schema import ChatCompletionRequest, CompletionRequest
from shared.tools import chat_prompt

logger = logging.getLogger(__name__)
T = TypeVar("T")

# Fields of tierline's schemas that steer the gateway, not the model: never sent upstream.
GATEWAY_FIELDS = ("tier", "quality", "speculation")
_decode = msgspec.json.Decoder().decode  # every relayed event: several times json.loads's speed
_encode = msgspec.json.Encoder().encode
_JSON = {"Content-Type": "application/json"}
_ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 429: "rate_limit_error"}


class UpstreamRequestError(ApplicationError):
    """The upstream refused the request (4xx): its status and message, in the OpenAI error shape (and its
    ``Retry-After``, as on a 429)."""

    def __init__(self, status: int, message: str, param: str | None, code: str | None) -> None:
        super().__init__(message, param=param, code=code)
        self.status_code = status
        self.error_type = _ERROR_TYPES.get(status, "invalid_request_error")
        self.retry_after: float | None = None


@dataclass(slots=True)
class RemoteLM:
    """One served model backed by an upstream server (``cloud.serving.engine_pool.Metered``)."""

    model_id: str
    config: UpstreamSpec
    pool: ReplicaPool
    tokenizer: ChatTokenizer
    max_model_len: int
    headers: dict[str, str] = field(default_factory=dict)
    version: int | None = None

    def affinity_key(self, caller: Caller, prompt: str | list[int]) -> str | None:
        """The request's prefix-affinity key (tenant and prompt prefix), None when affinity is off."""
        n = self.config.affinity_prefix_chars
        if not n:
            return None
        head = prompt[:n] if isinstance(prompt, str) else ",".join(map(str, prompt[:n]))
        return f"{caller.tenant.id}\x00{head}"


def make_pool(model_id: str, spec: UpstreamSpec, egress: EgressPolicy | None = None) -> ReplicaPool:
    """The replica pool for ``spec`` (its host names resolved now when ``resolve_dns`` or ``egress``: blocking).
    ``egress``: a registry serving spec's roots, checked (ConfigurationError naming the refused ones) and pinned;
    None: the operator's backends file, taken as written."""
    if egress is not None:
        roots, refused = pinned_roots(spec.roots(), egress, spec.resolve_dns)
        if refused:
            raise ConfigurationError("; ".join(refused))
    elif spec.resolve_dns:
        roots = resolve_roots(spec.roots())
    else:
        roots = [(r, None) for r in spec.roots()]
    return ReplicaPool(
        model_id,
        [Endpoint(root, spec.max_concurrency, host=host) for root, host in roots],
        eject_after_failures=spec.eject_after_failures,
        eject_s=spec.eject_s,
        probe_interval_s=spec.probe_interval_s,
        queue_timeout_s=spec.queue_timeout_s,
        health_path=spec.health_path,
        affinity_load_factor=spec.affinity_load_factor,
        resolve_dns=spec.resolve_dns,
        sources=spec.roots(),
        endpoint_concurrency=spec.max_concurrency,
        egress=egress,
    )


def make_remote(
    model_id: str,
    spec: UpstreamSpec,
    tokenizer: Path,
    version: int | None = None,
    *,
    keys: KeySources | None = None,
    egress: EgressPolicy | None = None,
) -> RemoteLM:
    """A served model answered by ``spec``'s upstream servers (blocking: loads the tokenizer, reads the key).

    Two levels of trust (``shared.backend_spec``): the operator's backends file (``keys`` and ``egress`` None: any
    key variable or file, any endpoint), and a registry serving spec (both given: the key only from the designated
    places, the endpoints checked and pinned)."""
    if not (tokenizer / "tokenizer.json").is_file() and not (tokenizer / "config.json").is_file():
        raise ConfigurationError(f"backend {model_id}: {tokenizer} holds no tokenizer")
    key = spec.api_key(keys)
    pool = make_pool(model_id if version is None else f"{model_id}@{version}", spec, egress)
    return RemoteLM(
        model_id,
        spec,
        pool,
        ChatTokenizer(tokenizer),
        context_length(spec, tokenizer),
        headers={"Authorization": f"Bearer {key}"} if key else {},
        version=version,
    )


@dataclass(slots=True)
class _Relay:
    """What a request got from the upstream so far: its usage, else the text relayed per choice."""

    usage: dict[str, Any] | None = None
    texts: dict[int, list[str]] = field(default_factory=dict)
    pieces: int = 0  # text pieces relayed so far (about a token each): when a usage checkpoint may be due

    def add(self, chunk: dict[str, Any], chat: bool) -> None:
        usage = chunk.get("usage")
        if _valid_usage(usage):
            self.usage = usage
        for choice in chunk.get("choices") or ():
            if not isinstance(choice, dict):
                continue
            index = choice.get("index", 0)
            source = (choice.get("delta") or choice.get("message") or {}) if chat else choice
            part = source.get("text" if not chat else "content") if isinstance(source, dict) else None
            parts = [part] if isinstance(part, str) and part else []
            for call in (source.get("tool_calls") or ()) if chat and isinstance(source, dict) else ():
                function = call.get("function") if isinstance(call, dict) else None  # counted as their text
                if isinstance(function, dict):
                    parts.extend(v for v in (function.get("name"), function.get("arguments")) if isinstance(v, str))
            if parts:
                self.texts.setdefault(index if isinstance(index, int) else 0, []).extend(parts)
                self.pieces += len(parts)


def _valid_usage(usage: Any) -> bool:
    return (
        isinstance(usage, dict)
        and isinstance(usage.get("prompt_tokens"), int)
        and isinstance(usage.get("completion_tokens"), int)
        and usage["prompt_tokens"] >= 0
        and usage["completion_tokens"] >= 0
    )


def _upstream_error(response: UpstreamResponse, body: bytes) -> UpstreamRequestError:
    message, param, code = f"upstream answered {response.status_code}", None, None
    with contextlib.suppress(ValueError, AttributeError, TypeError):
        error = json.loads(body)["error"]
        if isinstance(error, dict):
            message = str(error.get("message") or message)
            param = error.get("param") if isinstance(error.get("param"), str) else None
            code = error.get("code") if isinstance(error.get("code"), str) else None
        elif isinstance(error, str):
            message = error
    if not message and body:
        message = body[:500].decode(errors="replace")
    error = UpstreamRequestError(response.status_code, message, param, code)
    with contextlib.suppress(ValueError):
        if "retry-after" in response.headers:
            error.retry_after = float(response.headers["retry-after"])
    return error


def _event_data(block: bytes) -> bytes | None:
    """The ``data`` of one server-sent event (its lines joined; comments and other fields skipped), None if none."""
    if block.startswith(b"data: ") and b"\n" not in block:  # the usual event: one data line
        return block[6:]
    data = [
        line[5:].removeprefix(b" ") if line.startswith(b"data:") else b""
        for line in block.split(b"\n")
        if line.startswith(b"data:") or line == b"data"
    ]
    return b"\n".join(data) if data else None


async def _sse_batches(chunks: AsyncIterator[bytes]) -> AsyncIterator[list[bytes]]:
    """The ``data`` of the server-sent events each read of ``chunks`` completes, one list per read that completes
    any: the relay handles and sends them together (one write for the tokens an upstream sent at once).

    Parsed as bytes, not through httpx's text and line decoders (several times the cost, on every relayed token):
    lines may end in LF, CRLF or CR; an event ends at an empty line (and at the end of the stream).
    """
    pending = b""
    try:
        async for chunk in chunks:
            buffer = pending + chunk
            if b"\r" in buffer:
                held = buffer.endswith(b"\r")  # maybe the first half of a CRLF: decided by the next read
                buffer = buffer[:-1] if held else buffer
                buffer = buffer.replace(b"\r\n", b"\n").replace(b"\r", b"\n") + (b"\r" if held else b"")
            *blocks, pending = buffer.split(b"\n\n")
            batch = [d for d in map(_event_data, blocks) if d is not None]
            if batch:
                yield batch
        last = _event_data(pending.replace(b"\r", b"\n").strip(b"\n")) if pending.strip() else None
        if last is not None:
            yield [last]
    finally:
        await _aclose(chunks)


async def _aclose(iterator: AsyncIterator[Any]) -> None:
    """Close an async generator the relay stops reading (at ``[DONE]``, or when the client leaves) here and now.

    One left to the garbage collector is closed by the event loop's finalizer hook: a ``call_soon_threadsafe``
    (with uvloop, an eventfd write and a wake-up of the loop) and a task running its ``aclose()``, for each of the
    two generators of every relayed stream.
    """
    aclose = getattr(iterator, "aclose", None)
    if aclose is not None:
        await aclose()


class Backends:
    """The ``openai`` backends of this gateway: the backends file's served models (by id), and registry versions
    whose serving spec names upstream servers (``cloud.serving.registry_models`` hands them in from its worker thread:
    ``attach``, ``update``, ``retire`` run on the event loop)."""

    MAX_CONNECTIONS = 1024  # registry versions come and go: connections are bounded by the pools' slots anyway

    def __init__(self, models: dict[str, RemoteLM], service: CompletionService, request_timeout_s: float) -> None:
        self.models = models
        self.service = service
        self.request_timeout_s = request_timeout_s
        slots = sum(len(m.pool.endpoints) * m.config.max_concurrency for m in models.values()) + 8
        slots = max(slots, self.MAX_CONNECTIONS)
        self.client = httpx.AsyncClient(  # health probes; requests too when a proxy is configured
            timeout=httpx.Timeout(request_timeout_s, connect=2.0),
            limits=httpx.Limits(max_connections=slots, max_keepalive_connections=slots),
        )
        self.upstream: UpstreamClient = upstream_client(self.client, request_timeout_s)
        self.pools = [m.pool for m in models.values()]
        self.collector = PoolCollector(self.pools)
        self.loop: asyncio.AbstractEventLoop | None = None
        self._retiring: set[asyncio.Task[None]] = set()

    @classmethod
    def from_file(
        cls, path: Path, service: CompletionService, request_timeout_s: float, taken: Collection[str] = ()
    ) -> Backends:
        spec = load_backends(path)
        models: dict[str, RemoteLM] = {}
        for model_id, cfg in spec.models.items():
            if model_id in taken:
                raise ConfigurationError(f"{path}: model '{model_id}' is already served by the built-in engine")
            if not (cfg.tokenizer / "tokenizer.json").is_file() and not (cfg.tokenizer / "config.json").is_file():
                raise ConfigurationError(f"{path}: models.{model_id}.tokenizer: {cfg.tokenizer} holds no tokenizer")
            models[model_id] = make_remote(model_id, cfg, cfg.tokenizer)
        return cls(models, service, request_timeout_s)

    def health(self) -> dict[str, dict[str, int]]:
        """Per served model: its endpoints (draining ones left out) and how many the pool admits (for /readyz)."""
        report: dict[str, dict[str, int]] = {}
        for pool in list(self.pools):
            live = [e for e in list(pool.endpoints) if not e.draining]
            report[pool.model_id] = {"endpoints": len(live), "admitted": sum(1 for e in live if e.admitted)}
        return report

    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        for remote in self.models.values():
            remote.pool.start(self.client)

    async def close(self) -> None:
        for task in list(self._retiring):
            task.cancel()
        await asyncio.gather(*self._retiring, return_exceptions=True)
        for pool in list(self.pools):
            await pool.close()
        await self.upstream.aclose()
        await self.client.aclose()

    # -- registry versions (called from a worker thread) ------------------------------------------------------
    def _on_loop(self, fn: Callable[..., object], *args: object) -> None:
        if self.loop is None:
            raise ConfigurationError("the backends are not started")
        self.loop.call_soon_threadsafe(fn, *args)

    def attach(self, remote: RemoteLM) -> None:
        """Start ``remote``'s pool (probes, DNS) and count it in the metrics."""
        self._on_loop(self._attach, remote)

    def _attach(self, remote: RemoteLM) -> None:
        self.pools.append(remote.pool)
        remote.pool.start(self.client)

    def update(self, remote: RemoteLM, spec: UpstreamSpec) -> None:
        """``spec`` differs from ``remote``'s in its endpoints only: apply the new list (joins and drains)."""
        self._on_loop(self._update, remote, spec)

    def _update(self, remote: RemoteLM, spec: UpstreamSpec) -> None:
        remote.config = spec
        pool = remote.pool
        pool.sources = spec.roots()
        if spec.resolve_dns or pool.egress is not None:  # a registry spec's roots are checked again on the way
            task = asyncio.create_task(pool.resolve(), name=f"resolving {pool.model_id}")
            self._retiring.add(task)
            task.add_done_callback(self._retiring.discard)
        else:
            pool.set_endpoints([(r, None) for r in spec.roots()], spec.max_concurrency)

    def retire(self, remote: RemoteLM) -> None:
        """``remote`` serves no more: its endpoints drain (requests in flight finish), then its pool closes."""
        self._on_loop(self._retire, remote)

    def _retire(self, remote: RemoteLM) -> None:
        task = asyncio.create_task(self._drain(remote.pool), name=f"draining {remote.pool.model_id}")
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)

    async def _drain(self, pool: ReplicaPool) -> None:
        pool.drain_all()
        deadline = time.monotonic() + self.request_timeout_s + 5.0
        while not pool.drained and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        await pool.close()
        if pool in self.pools:
            self.pools.remove(pool)
        logger.info("backend %s: drained and closed", pool.model_id)

    def serves(self, model: str) -> bool:
        return model in self.models

    def model_ids(self) -> list[str]:
        return sorted(self.models)

    @staticmethod
    def _chosen(remote: Metered | None) -> RemoteLM | None:
        """The upstream-served version routing chose: the pool holds those as ``Metered`` (it sits below this
        module), and every one of them is a ``RemoteLM`` made here."""
        if remote is not None and not isinstance(remote, RemoteLM):
            raise TypeError(f"an upstream request was routed to {type(remote).__name__}, not an upstream model")
        return remote

    def _get(self, caller: Caller, model: str) -> RemoteLM:
        allowed = caller.key.allowed_models if caller.key is not None else None
        if allowed and model not in allowed:
            raise PermissionDeniedError(f"this API key may not use model '{model}'", param="model")
        return self.models[model]

    # -- requests -----------------------------------------------------------------------------------------------
    async def chat(
        self, caller: Caller, req: ChatCompletionRequest, remote: Metered | None = None
    ) -> dict[str, Any] | AsyncIterator[bytes]:
        """``remote``: the registry version routing chose (the caller's key was checked then), else the backends
        file's model ``req.model``."""
        remote = self._chosen(remote) or self._get(caller, req.model)
        self.service._checked_size(m.text() for m in req.messages)
        prompt = chat_prompt(req, remote.tokenizer)  # counted as the engine would see it (tools and calls too)
        counts = [await _count(remote, prompt)]
        key = remote.affinity_key(caller, prompt)
        return await self._run(
            caller, remote, req, "/v1/chat/completions", counts, req.max_new_tokens, chat=True, key=key
        )

    async def completions(
        self, caller: Caller, req: CompletionRequest, remote: Metered | None = None
    ) -> dict[str, Any] | AsyncIterator[bytes]:
        remote = self._chosen(remote) or self._get(caller, req.model)
        prompts = req.prompts()
        self.service._checked_size(p for p in prompts if isinstance(p, str))
        counts = [await _count(remote, p) if isinstance(p, str) else len(p) for p in prompts]
        key = remote.affinity_key(caller, prompts[0]) if prompts else None
        return await self._run(caller, remote, req, "/v1/completions", counts, req.max_tokens, chat=False, key=key)

    async def _run(
        self,
        caller: Caller,
        remote: RemoteLM,
        req: ChatCompletionRequest | CompletionRequest,
        path: str,
        counts: list[int],
        max_tokens: int | None,
        *,
        chat: bool,
        key: str | None = None,
    ) -> dict[str, Any] | AsyncIterator[bytes]:
        reserved = prompt_worst = completion_worst = 0
        for num in counts:  # refused as the built-in engine refuses: the prompt and its completion must fit
            max_new = check_context_length(num, max_tokens, remote.max_model_len)
            reserved += num + max_new * req.n
            prompt_worst += num * req.n
            completion_worst += max_new * req.n
        caller.model_version = str(remote.version) if remote.version is not None else None
        opening = sum(counts) if req.stream else None  # a stream's first checkpoint: what its checkpoints count
        meter = await self.service.reserve(caller, remote, reserved, Tokens(prompt_worst, completion_worst), opening)
        body = req.model_dump(mode="json", exclude_unset=True, by_alias=True)  # json_schema.schema, not schema_
        for name in GATEWAY_FIELDS:
            body.pop(name, None)
        body["model"] = remote.config.upstream_model
        body["cache_salt"] = caller.cache_salt
        if req.stream:
            body["stream_options"] = {"include_usage": True}
        prefix = "chatcmpl" if chat else "cmpl"
        rewrite = {"id": f"{prefix}-{caller.request_id}", "model": remote.model_id}
        relay = _Relay()

        billed = False

        async def bill(status: str, server_failure: bool = False) -> dict[str, Any]:
            """Settle once (reservations back, one usage record); the usage billed."""
            nonlocal billed
            if billed:
                return meter.usage()
            billed = True
            usage = relay.usage
            if usage is not None:
                meter.prompt_tokens = usage["prompt_tokens"]
                meter.completion_tokens = usage["completion_tokens"]
                details = usage.get("prompt_tokens_details")
                cached = details.get("cached_tokens") if isinstance(details, dict) else None
                meter.cached_tokens = cached if isinstance(cached, int) and cached >= 0 else 0
                source = "upstream"
            else:  # counted here: what the upstream was sent and what it sent back
                meter.prompt_tokens = sum(counts) if relay.texts or status == "ok" else 0
                meter.completion_tokens = sum(
                    len(remote.tokenizer.encode("".join(parts))) for parts in relay.texts.values()
                )
                source = "gateway"
            await self.service._settle(
                caller, remote, meter, status, usage_source=source, server_failure=server_failure
            )
            return meter.usage()

        relayed_at_checkpoint = 0

        async def checkpoint() -> None:
            """Make the stream's usage so far durable, when one is due (as the built-in engine's streams do): the
            upstream tells usage only at the end, so what was relayed is counted here with the model's tokenizer.
            A gateway killed mid-stream then leaves a checkpoint, billed as ``interrupted`` after its lease."""
            nonlocal relayed_at_checkpoint
            if billed or not self.service.usage.is_checkpoint_due(
                relay.pieces - relayed_at_checkpoint, meter.checkpoint_age()
            ):
                return
            meter.prompt_tokens = sum(counts)
            # Both undercount, never over: re-encoding merges tokens the model emitted apart, and a piece may
            # carry several tokens. The larger is kept; the upstream's usage replaces it when the stream ends.
            encoded = sum(len(remote.tokenizer.encode("".join(parts))) for parts in relay.texts.values())
            meter.completion_tokens = max(encoded, relay.pieces)
            relayed_at_checkpoint = relay.pieces
            await self.service._checkpoint(caller, remote, meter, due=True)

        if not req.stream:
            status, failed = "error", False
            try:
                async with asyncio.timeout(self.request_timeout_s):
                    endpoint, response, answer = await self._call(remote, path, body, _read_json, key)
                    await response.aclose()  # read whole: the endpoint is done with it
                    remote.pool.release(endpoint, True)
                if isinstance(req, CompletionRequest):
                    _check_prompt_logprobs(remote, req, answer)  # before it counts: a refused answer bills nothing
                relay.add(answer, chat)
                if relay.usage is None and relay.texts:
                    meter.first_token_at = time.monotonic()
                status = "ok"
            except TimeoutError:
                status = "deadline"
                raise DeadlineExceededError(
                    f"the request ran past the {self.request_timeout_s:.0f}s deadline"
                ) from None
            except asyncio.CancelledError:
                status = "abandoned"
                raise
            except (BadGatewayError, UpstreamUnavailableError):
                failed = True
                raise
            finally:
                await bill(status, failed)
            answer.update(rewrite)
            if relay.usage is None:
                answer["usage"] = meter.usage()
            return answer

        try:
            endpoint, response, (batches, first) = await self._call(remote, path, body, _first_event, key)
        except BaseException as exc:
            await bill("error", isinstance(exc, (BadGatewayError, UpstreamUnavailableError)))
            raise
        include_usage = req.include_usage
        return self._relay(
            remote, endpoint, response, batches, first, relay, rewrite, include_usage, chat, bill, checkpoint
        )

    async def _relay(
        self,
        remote: RemoteLM,
        endpoint: Endpoint,
        response: UpstreamResponse,
        batches: AsyncIterator[list[bytes]],
        first: list[bytes],
        relay: _Relay,
        rewrite: dict[str, str],
        include_usage: bool,
        chat: bool,
        bill: Callable[[str], Awaitable[dict[str, Any]]],
        checkpoint: Callable[[], Awaitable[None]],
    ) -> AsyncIterator[bytes]:
        status, ok = "abandoned", None
        try:
            async with asyncio.timeout(self.request_timeout_s):
                batch: list[bytes] | None = first
                is_done = False
                out: list[bytes] = []
                while batch is not None and not is_done:
                    out = []  # the batch's events, sent in one write
                    for data in batch:
                        if data == b"[DONE]":
                            is_done = True
                            break
                        try:
                            chunk = _decode(data)
                        except msgspec.DecodeError:
                            raise httpx.DecodingError(
                                f"upstream sent an event that is not JSON: {data[:80]!r}"
                            ) from None
                        if not isinstance(chunk, dict):
                            raise httpx.DecodingError("upstream sent an event that is not a JSON object")
                        if "error" in chunk:  # the upstream failed the stream itself: relayed as it is
                            status, ok = "error", False
                            if out:
                                await checkpoint()
                                yield b"".join(out)
                            yield sse(chunk)
                            return
                        relay.add(chunk, chat)
                        if not include_usage:
                            chunk.pop("usage", None)
                        if chunk.get("choices") or include_usage:
                            out.append(sse({**chunk, **rewrite}))
                    if out and not is_done:  # the last batch's events go out with [DONE], once billed
                        await checkpoint()  # before the bytes: a crash after them leaves them billed
                        yield b"".join(out)
                    if not is_done:
                        batch = await anext(batches, None)
                if not is_done:
                    raise httpx.RemoteProtocolError("upstream closed the stream before [DONE]")
            status, ok = "ok", True
            # Billed before [DONE]: a stream the client saw end is never unbilled (to its end, should it leave now).
            counted = await run_to_end(bill("ok"))
            if include_usage and relay.usage is None:  # counted here: the client still gets its usage chunk
                out.append(sse({**rewrite, "object": _chunk_object(chat), "choices": [], "usage": counted}))
            out.append(SSE_DONE)
            yield b"".join(out)  # one write: the events that came with the upstream's [DONE], usage, [DONE]
        except (httpx.HTTPError, OSError) as exc:
            status, ok = "error", False
            logger.warning("backend %s: stream from %s failed: %s", remote.model_id, endpoint.root, exc)
            err = BadGatewayError(f"upstream {remote.model_id} failed mid-stream: {type(exc).__name__}")
            yield sse(err.to_openai())
        except TimeoutError:
            status = "deadline"
            err2 = DeadlineExceededError(f"the request ran past the {self.request_timeout_s:.0f}s deadline")
            yield sse(err2.to_openai())
        finally:

            async def finish() -> None:
                try:
                    await _aclose(batches)  # stopped at [DONE] (or the client left): closed now, not by the GC
                finally:
                    await response.aclose()  # a client that left: closing the connection aborts the upstream request
                    remote.pool.release(endpoint, ok)
                    await bill(status)  # once: a stream that ended well was billed before its [DONE]

            await run_to_end(finish())

    async def _call(
        self,
        remote: RemoteLM,
        path: str,
        body: dict[str, Any],
        read: Callable[[UpstreamResponse], Awaitable[T]],
        key: str | None = None,
    ) -> tuple[Endpoint, UpstreamResponse, T]:
        """Send ``body`` to an endpoint of ``remote`` and ``read`` the start of its answer (non-stream: all of it;
        stream: the first event), failing over to another endpoint while nothing has reached the client."""
        tried: set[str] = set()
        last: str | None = None
        content = _encode(body)  # once, whatever the retries; msgspec: a fraction of httpx's json.dumps
        while True:
            try:
                endpoint = await remote.pool.acquire(tried, key)
            except UpstreamUnavailableError as exc:
                if last is None:
                    raise
                raise BadGatewayError(
                    f"model '{remote.model_id}': upstream failed ({last}) on {len(tried)} endpoint(s)",
                    retry_after=exc.retry_after,
                ) from None
            tried.add(endpoint.root)
            headers = {**remote.headers, **_JSON}
            if endpoint.host:
                headers["Host"] = endpoint.host
            response: UpstreamResponse | None = None
            try:
                response = await self.upstream.post(f"{endpoint.root}{path}", content, headers)
                if response.status_code >= 500:
                    last = f"{endpoint.root} answered {response.status_code}"
                    await response.aclose()
                    remote.pool.release(endpoint, False)
                    continue
                if response.status_code >= 400:  # the request's fault, not the endpoint's: passed through
                    raise _upstream_error(response, await response.aread())
                result = await read(response)
            except (httpx.HTTPError, OSError) as exc:
                last = f"{endpoint.root}: {type(exc).__name__}"
                if response is not None:
                    await response.aclose()
                remote.pool.release(endpoint, False)
                continue
            except BaseException:
                if response is not None:
                    await response.aclose()
                    remote.pool.release(endpoint, None)
                raise
            return endpoint, response, result


async def _read_json(response: UpstreamResponse) -> dict[str, Any]:
    data = await response.aread()
    try:
        answer = msgspec.json.decode(data)
    except msgspec.DecodeError:
        raise httpx.DecodingError("upstream answered with a body that is not JSON") from None
    if not isinstance(answer, dict):
        raise httpx.DecodingError("upstream answered with a body that is not a JSON object")
    return answer


async def _first_event(response: UpstreamResponse) -> tuple[AsyncIterator[list[bytes]], list[bytes]]:
    batches = _sse_batches(response.aiter_bytes())
    first = await anext(batches, None)
    if first is None:
        raise httpx.RemoteProtocolError("upstream closed the stream before its first event")
    return batches, first


async def _count(remote: RemoteLM, prompt: str) -> int:
    """The prompt's tokens; one over ``MAX_INLINE_PROMPT_BYTES`` is counted in a worker thread (milliseconds to
    seconds of work that would stall every other request on the event loop)."""
    if len(prompt) > MAX_INLINE_PROMPT_BYTES // 4 and len(prompt.encode()) > MAX_INLINE_PROMPT_BYTES:
        return (await asyncio.to_thread(remote.tokenizer.encode_counted, prompt, remote.max_model_len))[1]
    return remote.tokenizer.encode_counted(prompt, remote.max_model_len)[1]


def _chunk_object(chat: bool) -> str:
    return "chat.completion.chunk" if chat else "text_completion"


def _check_prompt_logprobs(remote: RemoteLM, req: CompletionRequest, answer: Any) -> None:
    """Refuse (400) an upstream answer that lacks the prompt logprobs the request asked for: an evaluation harness
    would score its empty or generated-only lists without an error."""
    if not req.wants_prompt_logprobs:
        return
    choices = answer.get("choices") if isinstance(answer, dict) else None
    for choice in choices if isinstance(choices, list) else [None]:
        choice = choice if isinstance(choice, dict) else {}
        if req.echo and req.logprobs is not None:
            logprobs = choice.get("logprobs")
            values = logprobs.get("token_logprobs") if isinstance(logprobs, dict) else None
            if not isinstance(values, list) or not values or values[0] is not None:
                param = "echo"
                break
        if req.prompt_logprobs is not None:
            values = choice.get("prompt_logprobs")
            if not isinstance(values, list) or not values:
                param = "prompt_logprobs"
                break
    else:
        return
    raise ValidationError(
        f"{param}: the upstream model server of '{remote.model_id}' does not return the prompt's logprobs "
        "(echo with logprobs, prompt_logprobs); a vLLM upstream or a built-in model does",
        param=param,
        code="unsupported_parameter",
    )
