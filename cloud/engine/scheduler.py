"""The scheduler (pure Python): which sequences run in the next step, and how many tokens each.

One token budget per step is shared by decodes (1 token, plus speculative tokens to verify) and chunked
prefills (vLLM V1's unified step). Running sequences go first, in priority then arrival order; waiting
ones are admitted while budget, blocks and ``max_num_seqs`` allow. When blocks run out the lowest-priority,
newest running sequence is preempted by recompute: its blocks are freed and it goes back to the front of
the waiting queue (its prefix may still be in the cache when it returns).
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field

from cloud.engine.block_manager import BlockManager
from cloud.engine.sequence import FinishReason, Sequence, SequenceStatus
from shared.errors import RateLimitError, ValidationError


class QueueFull(RateLimitError):  # noqa: N818 (the name the API layer and docs use)
    """The waiting queue is at its bound; the API answers 429 with Retry-After."""

    code = "overloaded"


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    max_num_queued_requests: int = 1024
    max_num_queued_tokens: int = 1_048_576
    watermark_blocks: int = 1

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if self.max_num_queued_requests < 1 or self.max_num_queued_tokens < 1:
            raise ValueError("max_num_queued_requests and max_num_queued_tokens must be >= 1")


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int

    @property
    def num_lookahead(self) -> int:
        """Speculative tokens reserved in this step (0 for prefill chunks)."""
        return self.seq.num_lookahead if self.num_new_tokens == 1 + self.seq.num_lookahead else 0


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self._num_queued_tokens = 0

    # -- queue --------------------------------------------------------------------------------------------------
    @property
    def num_queued_tokens(self) -> int:
        """Tokens still to compute for the waiting sequences (what ``max_num_queued_tokens`` bounds)."""
        return self._num_queued_tokens

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, seqs: list[Sequence]) -> None:
        """Queue the sequences of one request, all or none.

        Raises ValidationError when one sequence at its longest could never fit the whole cache, and QueueFull
        at the queue bound.
        """
        bm = self.block_manager
        for seq in seqs:
            need = bm.blocks_needed(seq.num_prompt_tokens + seq.max_tokens)
            if need > bm.num_blocks:
                raise ValidationError(
                    f"the request needs up to {need} KV blocks ({seq.num_prompt_tokens} prompt + {seq.max_tokens} "
                    f"completion tokens) but the cache holds {bm.num_blocks}; reduce the prompt or max_tokens",
                    param="max_tokens",
                )
        tokens = sum(s.num_uncomputed_tokens for s in seqs)
        if len(self.waiting) + len(seqs) > self.config.max_num_queued_requests:
            raise QueueFull(f"the engine queue is full ({len(self.waiting)} waiting); retry later", retry_after=1.0)
        if self._num_queued_tokens + tokens > self.config.max_num_queued_tokens:
            raise QueueFull(
                f"the engine queue is full ({self._num_queued_tokens} tokens waiting); retry later", retry_after=1.0
            )
        for seq in seqs:
            self._enqueue(seq)

    def add_forked(self, seq: Sequence) -> None:
        """Queue a sibling of an admitted request (n > 1); siblings are not counted against the bounds again."""
        self._enqueue(seq)

    def _enqueue(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, seq, key=Sequence.sort_key)
        self._num_queued_tokens += seq.num_uncomputed_tokens

    def _dequeue(self, seq: Sequence) -> None:
        self.waiting.remove(seq)
        self._num_queued_tokens -= seq.num_uncomputed_tokens

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """End a sequence wherever it is and free its blocks at once."""
        if seq.status is SequenceStatus.FINISHED:
            return
        if seq.status is SequenceStatus.WAITING and seq in self.waiting:
            self._dequeue(seq)
        elif seq in self.running:
            self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_lookahead = 0
        seq.spec_token_ids.clear()
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    # -- step ---------------------------------------------------------------------------------------------------
    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.draft_num_computed_tokens = 0
        seq.num_lookahead = 0
        seq.spec_token_ids.clear()
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(seq)
        out.preempted.append(seq)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        bm = self.block_manager
        self.running.sort(key=Sequence.sort_key)
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = seq.num_uncomputed_tokens
            if num_new > 1 or 1 + seq.num_lookahead > budget:
                seq.num_lookahead = 0
            num_new = min(num_new + seq.num_lookahead, budget)
            while not bm.can_allocate(seq, num_new):
                if seq.num_lookahead:
                    seq.num_lookahead = 0
                    num_new = min(seq.num_uncomputed_tokens, budget)
                    continue
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is seq:
                    break
            else:
                bm.allocate(seq, num_new)
                out.scheduled.append(ScheduledSeq(seq, num_new))
                budget -= num_new
                i += 1
                continue
            break
        if out.preempted:
            return out
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            # Keep a few blocks for the running sequences to grow into; with none running, use them all.
            reserve = self.config.watermark_blocks if self.running else 0
            hits: list[int] = []
            if seq.block_table:  # a forked sibling already shares its parent's prompt blocks
                num_new = min(seq.num_uncomputed_tokens, budget)
                if not bm.can_allocate(seq, num_new, reserve=reserve):
                    break
            else:
                # A request that wants its prompt's logprobs computes every prompt position (vLLM skips the cache).
                hits = [] if seq.needs_prompt_logits else bm.find_cached_prefix(seq)
                computed = len(hits) * bm.block_size
                num_new = min(seq.num_tokens - computed, budget)
                need = bm.blocks_needed(computed + num_new) - len(hits) + bm.num_free_among(hits)
                if need > bm.num_free_blocks - reserve:
                    break
            self._dequeue(seq)
            if not seq.block_table:
                seq.num_computed_tokens = bm.allocate_cached_prefix(seq, hits)
                if seq.num_preemptions == 0:
                    seq.num_cached_tokens = min(seq.num_computed_tokens, seq.num_prompt_tokens)
            bm.allocate(seq, num_new)
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.monotonic()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, num_new))
            budget -= num_new
        return out
