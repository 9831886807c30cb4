"""One generation in flight: its tokens, its KV blocks and how far the model has computed it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from cloud.engine.sampling_params import SamplingParams
from shared.openai_responses import Logprob
from shared.structured import Constraint


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


@dataclass(eq=False, slots=True)
class Sequence:
    """Token state of one output of a request (a request with ``n`` > 1 has ``n`` sequences).

    ``token_ids`` holds the prompt then the output. ``num_computed_tokens`` counts tokens whose K/V are in
    the cache; the scheduler feeds ``token_ids[num_computed_tokens:]`` (in chunks) and, once all are
    computed, a new token is sampled. ``num_lookahead`` is how many speculative tokens the engine wants to
    verify in the next step (the scheduler reserves room for them); ``spec_token_ids`` are those proposals.
    """

    seq_id: int
    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    arrival_time: float
    priority: int = 0
    cache_salt: str | None = None
    max_tokens: int = 16
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    num_lookahead: int = 0
    spec_token_ids: list[int] = field(default_factory=list)
    spec_method: str | None = None
    sibling_index: int = 0
    draft_num_computed_tokens: int = 0
    num_preemptions: int = 0
    num_spec_proposed: int = 0
    num_spec_accepted: int = 0
    parent: Sequence | None = None
    logprobs: list[Logprob] = field(default_factory=list)
    prompt_logprobs: list[Logprob] = field(default_factory=list)  # of prompt tokens 1.., as the prefill reaches them
    finish_reason: FinishReason | None = None
    first_token_time: float | None = None
    first_scheduled_time: float | None = None  # time.monotonic() when it first left the waiting queue
    constraint: Constraint | None = None  # params.grammar's matcher, advanced with each appended token

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_prefilling(self) -> bool:
        """True while prompt tokens (or tokens lost to preemption) remain beyond the last one."""
        return self.num_uncomputed_tokens > 1

    @property
    def needs_prompt_logits(self) -> bool:
        """True while prompt positions whose logits ``params.prompt_logprobs`` asks for remain uncollected (the
        request's first sequence only: siblings share its prompt)."""
        want = self.params.prompt_logprobs is not None and self.sibling_index == 0
        return want and len(self.prompt_logprobs) < self.num_prompt_tokens - 1

    def sort_key(self) -> tuple[int, float, int]:
        """Lower sorts first: priority class, then arrival (FCFS), then id."""
        return (self.priority, self.arrival_time, self.seq_id)
