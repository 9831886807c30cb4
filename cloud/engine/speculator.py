"""Speculative decoding: proposals (a draft model, or n-grams looked up in the prompt) and the adaptive
controller that picks k from the observed acceptance and the measured cost of a step — and turns
speculation off when a large batch makes verifying extra tokens cost more than it saves."""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Callable

import torch

from cloud.engine.model_runner import Feed, ModelRunner
from cloud.engine.sampler import Sampler
from cloud.engine.sequence import Sequence

CALIBRATION_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def ngram_proposal(token_ids: list[int], k: int, max_n: int = 4, min_n: int = 1) -> list[int]:
    """Prompt lookup: find the latest earlier occurrence of the last n tokens (longest n first) and propose
    the k tokens that followed it."""
    size = len(token_ids)
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        tail = token_ids[size - n :]
        for start in range(size - n - 1, -1, -1):
            if token_ids[start : start + n] == tail:
                follow = token_ids[start + n : start + n + k]
                if follow:
                    return follow
    return []


class StepCost:
    """Seconds per forward as a function of tokens in the step, measured once and interpolated."""

    def __init__(self, sizes: list[int], seconds: list[float]) -> None:
        self.sizes = sizes
        self.seconds = seconds

    @classmethod
    def measure(cls, runner: ModelRunner, max_tokens: int, repeats: int = 5) -> StepCost:
        """Time decode-shaped batches (one token per sequence, short contexts) on the empty cache.

        The best of several runs, made non-decreasing in the number of tokens, so that a noisy neighbour
        during start-up does not make small steps look dearer than large ones.
        """
        sizes = [s for s in CALIBRATION_SIZES if s <= max_tokens] or [1]
        blocks = list(range(min(runner.num_blocks, 4)))
        seconds = []
        for size in sizes:
            feeds = [Feed(blocks, [0], 8, 1) for _ in range(size)]
            runner.execute(feeds)
            best = float("inf")
            for _ in range(repeats):
                t0 = time.perf_counter()
                runner.execute(feeds)
                best = min(best, time.perf_counter() - t0)
            seconds.append(best)
        for i in range(len(seconds) - 2, -1, -1):
            seconds[i] = min(seconds[i], seconds[i + 1])
        return cls(sizes, seconds)

    def __call__(self, num_tokens: int) -> float:
        sizes, secs = self.sizes, self.seconds
        if num_tokens <= sizes[0]:
            return secs[0]
        if num_tokens >= sizes[-1]:
            return secs[-1] * num_tokens / sizes[-1]
        i = bisect_left(sizes, num_tokens)
        lo, hi = sizes[i - 1], sizes[i]
        return secs[i - 1] + (secs[i] - secs[i - 1]) * (num_tokens - lo) / (hi - lo)


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens produced per verification with k proposals each accepted with probability alpha."""
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


class SpecController:
    """Chooses k per step: argmax over k of expected tokens per second, k = 0 meaning no speculation.

    The per-token acceptance alpha is estimated from verification rounds: each accepted proposal is a success
    and each round that stopped at a rejection is one failure (later proposals of that round were never
    tested), with exponential forgetting. While speculation is off, one step in ``PROBE_EVERY`` still
    proposes a single token so the estimate can recover when the text becomes predictable again.
    """

    PROBE_EVERY = 16
    DECAY = 0.98

    def __init__(
        self,
        max_k: int,
        target_cost: Callable[[int], float],
        draft_cost: Callable[[int], float] | None,
        adaptive: bool = True,
    ) -> None:
        self.max_k = max_k
        self.target_cost = target_cost
        self.draft_cost = draft_cost
        self.adaptive = adaptive
        # Decayed (successes, trials), starting from a weak prior.
        self._evidence = {"draft": [3.5, 5.0], "ngram": [2.5, 5.0]}
        self._num_off = {"draft": 0, "ngram": 0}

    def acceptance(self, method: str) -> float:
        successes, trials = self._evidence[method]
        return successes / trials

    def record(self, method: str, proposed: int, accepted: int) -> None:
        if proposed <= 0:
            return
        ev = self._evidence[method]
        ev[0] = self.DECAY * ev[0] + accepted
        ev[1] = self.DECAY * ev[1] + accepted + (1 if accepted < proposed else 0)

    def choose_k(self, method: str, num_seqs: int, num_other_tokens: int) -> int:
        if not self.adaptive:
            return self.max_k
        alpha = min(self.acceptance(method), 0.99)
        base = num_seqs / self.target_cost(num_other_tokens + num_seqs)
        best_k, best = 0, base
        for k in range(1, self.max_k + 1):
            seconds = self.target_cost(num_other_tokens + num_seqs * (k + 1))
            if method == "draft" and self.draft_cost is not None:
                seconds += k * self.draft_cost(num_seqs)
            rate = num_seqs * expected_tokens(alpha, k) / seconds
            if rate > best * 1.02:
                best_k, best = k, rate
        if best_k == 0:
            self._num_off[method] += 1
            if self._num_off[method] % self.PROBE_EVERY == 0:
                return 1
        return best_k


class DraftProposer:
    """Runs the draft model k steps ahead for a batch of sequences; the draft shares the target's block
    tables (same block ids, its own KV tensors) and catches up on tokens it has not seen."""

    def __init__(self, runner: ModelRunner, sampler: Sampler) -> None:
        self.runner = runner
        self.sampler = sampler

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence]) -> dict[int, torch.Tensor | None]:
        """Fill ``seq.spec_token_ids`` (``seq.num_lookahead`` tokens); returns draft probs [k, V] per
        sampled sequence (None for greedy ones)."""
        probs: dict[int, list[torch.Tensor]] = {s.seq_id: [] for s in seqs}
        feeds = [
            Feed(s.block_table, s.token_ids[s.draft_num_computed_tokens :], s.draft_num_computed_tokens, 1)
            for s in seqs
        ]
        for seq in seqs:
            seq.spec_token_ids = []
        active = list(seqs)
        while active:
            logits = self.runner.execute(feeds)
            next_active = []
            for seq, row in zip(active, logits, strict=True):
                if seq.params.is_greedy:
                    token = int(torch.argmax(row))
                else:
                    p = self.sampler.probs(row, seq.params)
                    probs[seq.seq_id].append(p)
                    token = self.sampler.draw(p, self.sampler.generator(seq))
                seq.spec_token_ids.append(token)
                if len(seq.spec_token_ids) < seq.num_lookahead:
                    next_active.append(seq)
            active = next_active
            feeds = [
                Feed(s.block_table, [s.spec_token_ids[-1]], s.num_tokens + len(s.spec_token_ids) - 1, 1) for s in active
            ]
        for seq in seqs:
            seq.draft_num_computed_tokens = seq.num_tokens + len(seq.spec_token_ids) - 1
        return {sid: (torch.stack(p) if p else None) for sid, p in probs.items()}
