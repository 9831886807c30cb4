"""What the engine returns: per-request outputs with text deltas, token ids, logprobs and usage."""

from __future__ import annotations

from dataclasses import dataclass, field

from cloud.engine.sequence import Logprob


@dataclass(slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(slots=True)
class CompletionOutput:
    """One of the ``n`` outputs of a request. ``delta_*`` hold what is new since the previous update."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Logprob] | None = None
    finish_reason: str | None = None
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: list[Logprob] = field(default_factory=list)
    num_spec_proposed: int = 0
    num_spec_accepted: int = 0


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    usage: Usage
    ttft_s: float | None = None
    queue_s: float | None = None  # time in the engine's waiting queue: arrival to first scheduled
    # On the final update: seconds from the request's hand-over to the engine (its arrival) to this update — the
    # engine's own latency for the request, queueing inside the engine included.
    engine_s: float | None = None
    # ``SamplingParams.prompt_logprobs``: the logprob of each prompt token after the first (one fewer than the prompt)
    prompt_logprobs: list[Logprob] | None = None

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason
