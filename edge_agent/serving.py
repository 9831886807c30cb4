"""The agent's local OpenAI-compatible inference: chat completions and completions, streamed or not.

Runs on the device's runtimes only (escalation to the cloud arrives with the escalation policy). Answers
carry ``x-tierline-tier: edge``. One prompt and ``n = 1`` per request: a device serves one sequence at a time.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from edge_agent.generation import LocalLM, LocalRequest, LocalStep
from shared.errors import NotFoundError, ValidationError
from shared.openai_responses import SSE_DONE, chat_logprob, completion_logprobs, sse
from shared.openai_schema import ChatCompletionRequest, CompletionRequest

LM_FORMATS = ("onnx-int8", "onnx", "tflite")


class LocalModels:
    """The verified LM artifacts, each loaded on first use."""

    def __init__(self, paths: dict[str, Path], num_threads: int) -> None:
        self.paths = paths
        self.num_threads = num_threads
        self._loaded: dict[str, LocalLM] = {}
        self._lock = threading.Lock()

    def get(self, model_id: str) -> LocalLM:
        path = self.paths.get(model_id)
        if path is None:
            raise NotFoundError(f"The model '{model_id}' does not exist on this device", param="model")
        with self._lock:
            if model_id not in self._loaded:
                self._loaded[model_id] = LocalLM(path, self.num_threads)
            return self._loaded[model_id]


def _request(
    lm: LocalLM,
    prompt_ids: list[int],
    req: ChatCompletionRequest | CompletionRequest,
    max_tokens: int | None,
    logprobs: int | None,
) -> LocalRequest:
    if req.n != 1:
        raise ValidationError("n: the edge agent generates one choice per request", param="n")
    if req.has_penalties:
        raise ValidationError(
            "presence_penalty, frequency_penalty and repetition_penalty are served by the cloud tier only",
            param="presence_penalty"
            if req.presence_penalty
            else "frequency_penalty"
            if req.frequency_penalty
            else "repetition_penalty",
        )
    local = LocalRequest(prompt_ids=prompt_ids, max_tokens=max_tokens, logprobs=logprobs, **req.token_choice())
    lm.check(local)
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


async def chat(models: LocalModels, req: ChatCompletionRequest) -> dict[str, Any] | AsyncIterator[bytes]:
    lm = await asyncio.to_thread(models.get, req.model)
    text = lm.tokenizer.apply_chat_template([{"role": m.role, "content": m.text()} for m in req.messages])
    local = _request(lm, lm.tokenizer.encode(text), req, req.max_new_tokens, req.num_logprobs)
    rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": req.model}
    if not req.stream:
        steps = [s async for s in _steps(lm, local)]
        content = "".join(s.delta_text for s in steps)
        lps = [s.logprob for s in steps if s.logprob is not None]
        return {
            "id": rid,
            "object": "chat.completion",
            "created": created,
            "model": req.model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": content},
                    "finish_reason": steps[-1].finish_reason,
                    "logprobs": {"content": [chat_logprob(lm.tokenizer, lp) for lp in lps]}
                    if local.logprobs is not None
                    else None,
                }
            ],
            "usage": _usage(len(local.prompt_ids), len(steps)),
        }

    async def body() -> AsyncIterator[bytes]:
        yield sse(
            {**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}
        )
        n = 0
        async for step in _steps(lm, local):
            n += 1
            chunk: dict[str, Any] = {"index": 0, "delta": {}, "finish_reason": step.finish_reason}
            if step.delta_text:
                chunk["delta"]["content"] = step.delta_text
            if step.logprob is not None:
                chunk["logprobs"] = {"content": [chat_logprob(lm.tokenizer, step.logprob)]}
            if step.delta_text or step.finish_reason or step.logprob is not None:
                yield sse({**base, "choices": [chunk]})
        if req.include_usage:
            yield sse({**base, "choices": [], "usage": _usage(len(local.prompt_ids), n)})
        yield SSE_DONE

    return body()


async def complete(models: LocalModels, req: CompletionRequest) -> dict[str, Any] | AsyncIterator[bytes]:
    lm = await asyncio.to_thread(models.get, req.model)
    prompts = req.prompts()
    if len(prompts) != 1:
        raise ValidationError("prompt: the edge agent takes one prompt per request", param="prompt")
    prompt = prompts[0]
    ids = lm.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
    local = _request(lm, ids, req, req.max_tokens, req.logprobs)
    rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    base = {"id": rid, "object": "text_completion", "created": created, "model": req.model}
    if not req.stream:
        steps = [s async for s in _steps(lm, local)]
        lps = [s.logprob for s in steps if s.logprob is not None]
        text = "".join(s.delta_text for s in steps)
        if req.echo:
            text = lm.tokenizer.decode(ids) + text
        return {
            **base,
            "choices": [
                {
                    "index": 0,
                    "text": text,
                    "finish_reason": steps[-1].finish_reason,
                    "logprobs": completion_logprobs(lm.tokenizer, lps) if local.logprobs is not None else None,
                }
            ],
            "usage": _usage(len(ids), len(steps)),
        }

    async def body() -> AsyncIterator[bytes]:
        n = 0
        async for step in _steps(lm, local):
            n += 1
            if step.delta_text or step.finish_reason:
                lp = completion_logprobs(lm.tokenizer, [step.logprob]) if step.logprob is not None else None
                choice = {"index": 0, "text": step.delta_text, "finish_reason": step.finish_reason, "logprobs": lp}
                yield sse({**base, "choices": [choice]})
        if req.include_usage:
            yield sse({**base, "choices": [], "usage": _usage(len(ids), n)})
        yield SSE_DONE

    return body()
