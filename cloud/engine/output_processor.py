"""``OutputProcessor``: the core's token ids turned into what a client gets, outside the engine step (vLLM v1's
``OutputProcessor``).

It detokenises each output incrementally, finds stop strings (the core knows only stop tokens, EOS and lengths),
keeps the stream interval and builds ``RequestOutput`` updates. An output a stop string ended is finished here at
once; the caller tells the core (``ProcessedOutputs.stopped``) so that it frees the sequence's blocks. The core may
meanwhile have run that sequence a step further (in a process of its own): tokens for a finished output are ignored.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cloud.engine.outputs import CompletionOutput, RequestOutput, Usage
from cloud.engine.protocol import AddRequest, EngineCoreOutput, EngineCoreOutputs
from cloud.engine.tokenizer import ChatTokenizer, IncrementalDetokenizer
from shared.openai_responses import Logprob


@dataclass(slots=True)
class _Output:
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Logprob] | None = None
    finish_reason: str | None = None
    num_spec_proposed: int = 0
    num_spec_accepted: int = 0


@dataclass(slots=True)
class _Request:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[_Output]
    arrival_time: float
    num_cached_tokens: int = 0
    first_token_time: float | None = None
    first_scheduled_time: float | None = None
    streamed: bool = False  # an update with tokens has gone out
    held: RequestOutput | None = None  # what the stream interval holds back, merged into the next update
    prompt_logprobs: list[Logprob] | None = None  # sent by the core with the first tokens


@dataclass(slots=True)
class ProcessedOutputs:
    outputs: list[RequestOutput]
    stopped: list[tuple[str, int]]  # (request id, output index) a stop string ended: the core must finish them


class OutputProcessor:
    """Per-request text state on the client's side of the core. Not thread-safe: one thread adds, aborts and
    processes (the engine's thread in one process; the event loop for ``EngineProcess``)."""

    def __init__(self, tokenizer: ChatTokenizer, stream_interval: int = 1) -> None:
        self.tokenizer = tokenizer
        self.stream_interval = stream_interval
        self._requests: dict[str, _Request] = {}

    def add_request(self, request: AddRequest) -> None:
        logprobs = request.params.logprobs is not None
        self._requests[request.request_id] = _Request(
            request.request_id,
            request.prompt_token_ids,
            [
                _Output(IncrementalDetokenizer(self.tokenizer, request.params.stop), logprobs=[] if logprobs else None)
                for _ in range(request.params.n)
            ],
            request.arrival_time,
        )

    def abort_request(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._requests

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    def process(self, core: EngineCoreOutputs) -> ProcessedOutputs:
        """A step's updates: one per request that progressed, unless the stream interval holds it back."""
        result = ProcessedOutputs([], [])
        for progress in core.outputs:
            req = self._requests.get(progress.request_id)
            if req is None:
                continue  # aborted, or finished by a stop string while the core ran on
            self._absorb(req, progress, core.token_time)
            output = self._output(req, result.stopped)  # every step: stop strings end an output as soon as they appear
            if req.held is not None:
                output, req.held = _merge(req.held, output), None
            if output.finished:
                output.engine_s = core.timestamp - req.arrival_time
                del self._requests[req.request_id]
            elif req.streamed and max(len(c.delta_token_ids) for c in output.outputs) < self.stream_interval:
                req.held = output  # neither the first tokens, nor the last, nor stream_interval of them yet
                continue
            req.streamed = True
            result.outputs.append(output)
        return result

    @staticmethod
    def _absorb(req: _Request, progress: EngineCoreOutput, token_time: float) -> None:
        req.num_cached_tokens = progress.num_cached_tokens
        if req.first_token_time is None:
            req.first_token_time = token_time
        if req.first_scheduled_time is None:
            req.first_scheduled_time = progress.first_scheduled_time
        for new in progress.sequences:
            if new.prompt_logprobs is not None:
                req.prompt_logprobs = new.prompt_logprobs
            out = req.outputs[new.index]
            if out.finish_reason is not None:
                continue
            out.token_ids.extend(new.new_token_ids)
            if out.logprobs is not None and new.new_logprobs:
                out.logprobs.extend(new.new_logprobs)
            out.finish_reason = new.finish_reason
            out.num_spec_proposed, out.num_spec_accepted = new.num_spec_proposed, new.num_spec_accepted

    @staticmethod
    def _output(req: _Request, stopped: list[tuple[str, int]]) -> RequestOutput:
        choices = [_choice(req, i, stopped) for i in range(len(req.outputs))]
        return RequestOutput(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            outputs=choices,
            finished=all(out.finish_reason is not None for out in req.outputs),
            usage=Usage(
                prompt_tokens=len(req.prompt_token_ids),
                completion_tokens=sum(len(o.token_ids) for o in req.outputs),
                cached_tokens=req.num_cached_tokens,
            ),
            ttft_s=(req.first_token_time - req.arrival_time) if req.first_token_time is not None else None,
            queue_s=max(0.0, req.first_scheduled_time - req.arrival_time)
            if req.first_scheduled_time is not None
            else None,
            prompt_logprobs=req.prompt_logprobs,
        )


def _choice(req: _Request, index: int, stopped: list[tuple[str, int]]) -> CompletionOutput:
    """Output ``index`` as of now: its new text (a stop string found in it finishes it) and what else is new."""
    out = req.outputs[index]
    detok = out.detokenizer
    delta_text, is_stopped = detok.update(out.token_ids, out.finish_reason is not None)
    if is_stopped and out.finish_reason is None:
        out.finish_reason = "stop"
        stopped.append((req.request_id, index))
    emitted = detok.num_emitted_tokens
    detok.num_emitted_tokens = len(out.token_ids)
    return CompletionOutput(
        index=index,
        text=detok.text,
        token_ids=list(out.token_ids),
        logprobs=list(out.logprobs) if out.logprobs is not None else None,
        finish_reason=out.finish_reason,
        delta_text=delta_text,
        delta_token_ids=out.token_ids[emitted:],
        delta_logprobs=out.logprobs[emitted:] if out.logprobs is not None else [],
        num_spec_proposed=out.num_spec_proposed,
        num_spec_accepted=out.num_spec_accepted,
    )


def _merge(held: RequestOutput, later: RequestOutput) -> RequestOutput:
    """``later`` carrying the deltas of ``held`` (an update the stream interval held back) before its own."""
    for before, choice in zip(held.outputs, later.outputs, strict=True):
        choice.delta_text = before.delta_text + choice.delta_text
        choice.delta_token_ids = before.delta_token_ids + choice.delta_token_ids
        choice.delta_logprobs = before.delta_logprobs + choice.delta_logprobs
    return later
