"""The agent's local OpenAI-compatible inference: chat completions and completions, streamed or not.

Runs on the device's runtimes only; ``edge_agent.tiering`` decides whether a request is answered here or by
the cloud. One prompt and ``n = 1`` per request: a device serves one sequence at a time.

A request is first *prepared* (model resolved, prompt tokenized, lengths checked), then either run whole
(``run``) or streamed (``stream``) from a step iterator, which lets the tiering layer look at the first
tokens before it commits a stream to the edge.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from edge_agent.generation import LocalLM, LocalRequest, LocalStep, ModelFaultError
from shared.artifacts import Manifest, verify_files
from shared.errors import ApplicationError, ArtifactVerificationError, NotFoundError, ValidationError
from shared.escalation import StepSignal, lm_signals
from shared.openai_responses import SSE_DONE, chat_logprob, completion_logprobs, sse
from shared.openai_schema import ChatCompletionRequest, CompletionRequest
from shared.structured import grammar_of
from shared.tools import StreamParser, chat_prompt
from shared.tools import grammar as chat_grammar
from shared.tools import message as chat_message

logger = logging.getLogger(__name__)

LM_FORMATS = ("onnx-int8", "onnx", "tflite", "gguf")


class LocalModels:
    """The verified LM artifacts, each loaded on first use, its files verified again just before: a file
    changed since start-up (or since the swap that brought it) is refused, never served."""

    def __init__(self, models: dict[str, tuple[Path, Manifest]], num_threads: int) -> None:
        self.paths = {model_id: path for model_id, (path, _) in models.items()}
        self.manifests = {model_id: manifest for model_id, (_, manifest) in models.items()}
        self.num_threads = num_threads
        self.variants: dict[str, str | None] = {}  # a model id served from one weight file of its artifact (GGUF)
        self._loaded: dict[str, LocalLM] = {}
        self._lock = threading.Lock()

    def alias(self, alias: str, model_id: str, variant: str | None = None) -> None:
        """Serve ``model_id`` under ``alias`` too (the same files, loaded and verified on their own; ``variant``
        names the weight file of a GGUF artifact)."""
        with self._lock:
            self.paths[alias], self.manifests[alias] = self.paths[model_id], self.manifests[model_id]
            self.variants[alias] = variant

    def replace(self, model_id: str, path: Path, manifest: Manifest, runtime: LocalLM) -> None:
        """Serve ``model_id`` from ``runtime`` from now on; requests holding the old runtime finish on it."""
        with self._lock:
            self.paths[model_id], self.manifests[model_id] = path, manifest
            self._loaded[model_id] = runtime

    def withdraw(self, model_id: str) -> None:
        """Stop serving ``model_id`` (requests already holding its runtime finish on it)."""
        with self._lock:
            self.paths.pop(model_id, None)
            self._loaded.pop(model_id, None)

    def has(self, model_id: str) -> bool:
        return model_id in self.paths

    def get(self, model_id: str) -> LocalLM:
        with self._lock:
            path = self.paths.get(model_id)
            if path is None:
                raise NotFoundError(
                    f"The model '{model_id}' does not exist on this device", param="model", code="model_not_found"
                )
            if model_id not in self._loaded:
                self._loaded[model_id] = self._load(model_id, path)
            return self._loaded[model_id]

    def _load(self, model_id: str, path: Path) -> LocalLM:
        try:
            verify_files(self.manifests[model_id], path)
        except ArtifactVerificationError as exc:
            logger.error("refusing %s: its files changed since they were verified (%s)", model_id, exc.message)
            del self.paths[model_id]
            raise NotFoundError(
                f"The model '{model_id}' failed verification on this device and is not served",
                param="model",
                code="model_not_found",
            ) from None
        try:
            return LocalLM(path, self.num_threads, self.variants.get(model_id))
        except ApplicationError:
            raise
        except Exception as exc:  # a verified file the runtime cannot load: the version's fault
            raise ModelFaultError(f"{model_id}: cannot load: {type(exc).__name__}: {exc}") from exc


def _request(
    lm: LocalLM,
    prompt_ids: list[int],
    req: ChatCompletionRequest | CompletionRequest,
    max_tokens: int | None,
    logprobs: int | None,
) -> LocalRequest:
    if req.n != 1:
        raise ValidationError(
            "n: the edge agent generates one choice per request (send it to the cloud for more)",
            param="n",
            code="unsupported_value",
        )
    if isinstance(req, CompletionRequest) and (req.wants_prompt_logprobs or req.max_tokens == 0):
        # The edge runtimes' prefill gives the last position's logits only (runtime.lm, runtime.gguf): the prompt's
        # logprobs are the cloud engine's; the tiering sends such a request up ("cloud-feature").
        raise ValidationError(
            "prompt_logprobs: the prompt's logprobs (echo with logprobs, prompt_logprobs, max_tokens 0) are served "
            "by the cloud tier only",
            param="prompt_logprobs",
            code="unsupported_parameter",
        )
    if req.has_penalties:
        raise ValidationError(
            "presence_penalty, frequency_penalty and repetition_penalty are served by the cloud tier only",
            param="presence_penalty"
            if req.presence_penalty
            else "frequency_penalty"
            if req.frequency_penalty
            else "repetition_penalty",
        )
    grammar = chat_grammar(req) if isinstance(req, ChatCompletionRequest) else grammar_of(req.response_format)
    local = LocalRequest(
        prompt_ids=prompt_ids,
        max_tokens=max_tokens,
        logprobs=logprobs,
        grammar=grammar,
        # a field the request leaves unset takes the checkpoint's generation_config.json default, as on the cloud
        **lm.tokenizer.generation.apply(req.token_choice(), req.model_fields_set),
    )
    lm.check(local)
    if grammar is not None:
        lm.check_grammar(grammar)
    return local


async def _steps(lm: LocalLM, req: LocalRequest) -> AsyncIterator[LocalStep]:
    """Generate in a worker thread; leaving the iterator early stops generation after the current token."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[LocalStep | BaseException | None] = asyncio.Queue()
    cancel = threading.Event()

    def work() -> None:
        try:
            for step in lm.generate(req):
                loop.call_soon_threadsafe(queue.put_nowait, step)
                if cancel.is_set():
                    break
        except BaseException as exc:  # handed to the consumer, which re-raises it
            loop.call_soon_threadsafe(queue.put_nowait, exc)
        finally:
            loop.call_soon_threadsafe(queue.put_nowait, None)

    worker = loop.run_in_executor(None, work)
    try:
        while (item := await queue.get()) is not None:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        cancel.set()
        if worker.done():
            worker.result()


def _usage(prompt: int, completion: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


Endpoint = Literal["chat.completions", "completions"]


@dataclass(slots=True)
class Prepared:
    """A request ready to run on a local model."""

    endpoint: Endpoint
    req: ChatCompletionRequest | CompletionRequest
    lm: LocalLM
    local: LocalRequest
    echo_text: str = ""
    steps_seen: list[LocalStep] = field(default_factory=list)
    logits_sum: np.ndarray | None = None  # over the sampled steps, when ``local.keep_logits``
    logits_steps: int = 0

    @property
    def prompt_tokens(self) -> int:
        return len(self.local.prompt_ids)

    @property
    def completion_tokens(self) -> int:
        return len(self.steps_seen)

    def signals(self) -> dict[str, float]:
        return lm_signals([s.signal for s in self.steps_seen if isinstance(s.signal, StepSignal)])

    def mean_logits(self) -> np.ndarray | None:
        """The generated tokens' logits averaged (the LM hidden-state probe's input, ``LinearProbe.input``
        ``mean_logits``), over the steps seen so far; None unless ``local.keep_logits`` and a token was sampled."""
        if self.logits_sum is None or self.logits_steps == 0:
            return None
        return self.logits_sum / self.logits_steps

    def record(self, step: LocalStep) -> None:
        """Keep ``step`` (usage, signals) and fold its logits into the running sum (not kept: one vector per
        answer, not one per token)."""
        if step.logits is not None:
            if self.logits_sum is None:
                self.logits_sum = np.zeros_like(step.logits, dtype=np.float64)
            self.logits_sum += step.logits
            self.logits_steps += 1
            step.logits = None
        self.steps_seen.append(step)


async def prepare(models: LocalModels, endpoint: Endpoint, req: ChatCompletionRequest | CompletionRequest) -> Prepared:
    lm = await asyncio.to_thread(models.get, req.model)
    if isinstance(req, ChatCompletionRequest):
        text = chat_prompt(req, lm.tokenizer)
        local = _request(lm, lm.tokenizer.encode(text), req, req.max_new_tokens, req.num_logprobs)
        return Prepared(endpoint, req, lm, local)
    prompts = req.prompts()
    if len(prompts) != 1:
        raise ValidationError("prompt: the edge agent takes one prompt per request", param="prompt")
    prompt = prompts[0]
    ids = lm.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
    local = _request(lm, ids, req, req.max_tokens, req.logprobs)  # checked first: ids outside the vocabulary are a 400
    echo = lm.tokenizer.decode(ids) if req.echo else ""
    return Prepared(endpoint, req, lm, local, echo)


def steps(p: Prepared) -> AsyncGenerator[LocalStep, None]:
    """The local generation, recording each step on ``p`` (for usage and signals)."""

    async def gen() -> AsyncGenerator[LocalStep, None]:
        async for step in _steps(p.lm, p.local):
            p.record(step)
            yield step

    return gen()


async def run(p: Prepared) -> dict[str, Any]:
    """Generate the whole answer locally."""
    done = [s async for s in steps(p)]
    lps = [s.logprob for s in done if s.logprob is not None]
    text = "".join(s.delta_text for s in done)
    created = int(time.time())
    if p.endpoint == "chat.completions":
        message, finish_reason = (
            chat_message(text, done[-1].finish_reason)
            if isinstance(p.req, ChatCompletionRequest) and p.req.calls_tools
            else ({"role": "assistant", "content": text}, done[-1].finish_reason)
        )
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": created,
            "model": p.req.model,
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "finish_reason": finish_reason,
                    "logprobs": {"content": [chat_logprob(p.lm.tokenizer, lp) for lp in lps]}
                    if p.local.logprobs is not None
                    else None,
                }
            ],
            "usage": _usage(p.prompt_tokens, len(done)),
        }
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": created,
        "model": p.req.model,
        "choices": [
            {
                "index": 0,
                "text": p.echo_text + text,
                "finish_reason": done[-1].finish_reason,
                "logprobs": completion_logprobs(p.lm.tokenizer, lps) if p.local.logprobs is not None else None,
            }
        ],
        "usage": _usage(p.prompt_tokens, len(done)),
    }


async def stream(p: Prepared, source: AsyncIterator[LocalStep]) -> AsyncIterator[bytes]:
    """Server-sent events for ``source`` (the steps of ``steps(p)``, possibly some already buffered)."""
    created = int(time.time())
    tok = p.lm.tokenizer
    if p.endpoint == "chat.completions":
        base = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion.chunk", "created": created}
        base["model"] = p.req.model
        tools = isinstance(p.req, ChatCompletionRequest) and p.req.calls_tools
        parser = StreamParser() if tools else None
        opening = {"role": "assistant"} if tools else {"role": "assistant", "content": ""}
        yield sse({**base, "choices": [{"index": 0, "delta": opening, "finish_reason": None}]})
        async for step in source:
            if parser is not None:  # tool calls: deltas of content or of tool_calls (shared.tools)
                calls = parser.chunks(0, step.delta_text, step.finish_reason)
                if step.logprob is not None:
                    calls = calls or [{"index": 0, "delta": {}, "finish_reason": None}]
                    calls[0]["logprobs"] = {"content": [chat_logprob(tok, step.logprob)]}
                for call in calls:
                    yield sse({**base, "choices": [call]})
                continue
            chunk: dict[str, Any] = {"index": 0, "delta": {}, "finish_reason": step.finish_reason}
            if step.delta_text:
                chunk["delta"]["content"] = step.delta_text
            if step.logprob is not None:
                chunk["logprobs"] = {"content": [chat_logprob(tok, step.logprob)]}
            if step.delta_text or step.finish_reason or step.logprob is not None:
                yield sse({**base, "choices": [chunk]})
    else:
        base = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": created}
        base["model"] = p.req.model
        async for step in source:
            if step.delta_text or step.finish_reason:
                lp = completion_logprobs(tok, [step.logprob]) if step.logprob is not None else None
                choice = {"index": 0, "text": step.delta_text, "finish_reason": step.finish_reason, "logprobs": lp}
                yield sse({**base, "choices": [choice]})
    if p.req.include_usage:
        yield sse({**base, "choices": [], "usage": _usage(p.prompt_tokens, p.completion_tokens)})
    yield SSE_DONE
