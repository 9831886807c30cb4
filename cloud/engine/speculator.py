"""Speculative decoding: proposals (a draft model, or n-grams looked up in the prompt) and the adaptive
controller that picks k for each step from the observed acceptance and the measured cost of the steps it runs —
plain steps and speculative ones, timed online, per concurrency — so that speculation is on only where it is
measured to pay."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from cloud.engine.model_runner import PARALLEL_MIN_MACS, Feed, ModelRunner
from cloud.engine.sampler import Sampler
from cloud.engine.sequence import Sequence

METHODS = ("draft", "ngram")


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


def expected_tokens(alpha: float, k: float) -> float:
    """Tokens produced per verification with k proposals each accepted with probability alpha."""
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def position_tokens(alphas: list[float], k: float) -> float:
    """Tokens per verification with k proposals (a fraction: that share of the next one), the i-th accepted with
    probability ``alphas[i]`` where the ones before it were (``SpecController.position_acceptance``)."""
    total = survive = 1.0
    whole = min(int(k), len(alphas))
    for alpha in alphas[:whole]:
        survive *= alpha
        total += survive
    if whole < len(alphas) and k > whole:
        total += (k - whole) * survive * alphas[whole]
    return total


def concurrency_bucket(num_seqs: int) -> int:
    """Steps are costed per bucket of decoding sequences: 1 to 8 each, then up to the next power of two (a sequence's
    share of a step of 5 costs ~1.4x its share of one of 8 on the demo LM: filed together, the batch's tail priced
    the full batch's steps)."""
    return num_seqs if num_seqs <= 8 else 1 << (num_seqs - 1).bit_length()


@dataclass(slots=True)
class _Cost:
    """Seconds per sequence of a step of one shape: the lower median of its first measurements, then an exponentially
    weighted mean of the steps measured, with the spread of those measurements."""

    seconds: float
    updated: int  # the controller's step count when last measured
    variance: float = 0.0  # exponentially weighted, of the measurements around the mean
    count: int = 1
    first: list[float] = field(default_factory=list)  # the first ``SpecController.FIRST_SAMPLES`` measurements

    def relative_error(self, weight: float, prior: float) -> float:
        """The standard error of the mean relative to it (``prior`` while only one measurement is in)."""
        if self.count < 2:
            return prior
        samples = min(self.count, (2.0 - weight) / weight)  # an exponentially weighted mean's effective samples
        return (self.variance / samples) ** 0.5 / self.seconds


class SpecController:
    """Chooses k per step and method: k = 0 (a plain step) unless speculating is expected to give at least
    ``MIN_GAIN`` times the tokens per second of plain decoding.

    Costs are measured, not modelled: the engine times every step in which all scheduled sequences decode
    (``record_step``) and files its seconds per sequence under the step's shape — plain, or one method with k
    proposals a sequence — and its concurrency bucket (``concurrency_bucket``), as an exponentially weighted mean
    after the lower median of its first ``FIRST_SAMPLES``, each measurement at most ``OUTLIER`` times the mean.
    Those are the steps it actually runs: the fused one-token step when plain (a decode burst's seconds a token),
    the draft's steps and the verification when speculating. Where a k is not measured ``FIRST_SAMPLES`` times yet
    in a bucket its cost is extrapolated from plain's and the ks that are (``_extrapolated``; its own measurements
    where lower; before any such k, ``prior_cost_per_token``: what a proposal added in the nearest
    smaller bucket, at least ``PRIOR_COST_PER_TOKEN`` of a plain step), so a promising k gets tried; a bucket's first
    ``FIRST_SAMPLES`` steps are plain, to measure the reference.
    Now and then a decision explores instead — while plain wins, the best speculative k; while speculation wins,
    the runner-up k, and plain one decision in ``PLAIN_EVERY`` — so that the estimates not being refreshed follow
    the host's load and the contexts' growth. Exploring is paid from a budget of ``EXPLORE_SHARE`` of the time (per
    method and bucket): an exploration spends what the estimates say it loses, so a choice far worse than the best
    is re-checked rarely and one nearly as good often (at most one decision in ``MIN_EXPLORE_GAP``).

    A draft that has not read its sequences' tokens (their prompts, or tokens decoded while speculation was off) reads
    them first, in a forward of its own: a catch-up, priced apart from the steps (``record_catch_up``: seconds a token,
    the recent catch-ups' decayed seconds over their tokens). Switching speculation on pays it once, so it is switched
    on only where the steps left to the sequences (their ``max_tokens``) are expected to save more than the catch-up
    costs; an exploration that makes the draft catch up spends that from its budget too. A batch where speculation
    loses thus never pays a whole batch's catch-up for one step of it, and a small batch where it wins still switches
    on at once.

    Tokens per step come from acceptance estimated from verification rounds, position by position
    (``position_acceptance``: the i-th proposal's, given the ones before it were accepted), beside a pooled rate
    alpha: each accepted proposal is a success and each round that stopped at a rejection is one failure (later
    proposals of that round were never tested), with exponential forgetting; n-gram lookups that find nothing
    (``record_lookups``) count as plain steps for the sequences concerned. A method's first ``MIN_ROUNDS`` rounds
    speculate where an optimistic acceptance would win (``_optimistic_k``): a few unlucky rounds do not switch it off
    for good.

    The engine times a step from its start to the next step's (``LLMEngine._file_step``): what its caller does with
    the step's outputs (detokenising, streaming, sending them to another process) is paid once a step, so it is part
    of the step's cost.
    """

    EXPLORE_SHARE = 0.008  # of the time: what exploring may cost, at most, by the estimates
    MIN_EXPLORE_GAP = 8  # decisions between two explorations, at least
    PLAIN_EVERY = 16  # while speculating, one decision in this many is plain
    # ... and one in PLAIN_EVERY_EARLY while plain has fewer than PLAIN_SETTLED measurements in the bucket: a
    # reference set by its first steps (on the demo LM at 4 concurrent they cost 1.5-2x the ones after) was left
    # standing for rounds, and n-gram speculation ran at 0.46-0.89x plain there "expecting" to win.
    PLAIN_EVERY_EARLY = 4
    PLAIN_SETTLED = 6
    MAX_SAVED_STEPS = 4.0
    # Speculation is chosen where the estimates expect it to give this many times plain's tokens a second. A step's
    # cost varies 10-30 % between identical steps on a 2-core host, and near break-even the estimates' errors decide:
    # at 1.02 n-gram speculation at 4-16 concurrent switched on and off on noise and ran at 0.93-0.97x plain in some
    # runs (and 0.88-0.96x at 8 at 1.05). Where it wins it wins by more (1.2-1.5x at batch 1).
    MIN_GAIN = 1.1
    # Before a method has this many verification rounds of acceptance evidence it speculates where it would win with
    # its acceptance ``LEARNING_ERRORS`` standard errors higher (``_optimistic_k``): that acceptance is its prior's
    # and a few rounds', and a method judged to lose is rarely tried again (a draft's exploration pays its catch-up).
    # From a start whose first 6 rounds accepted 0.69 the draft stopped at batch 1 for good, where its acceptance
    # was 0.93 and it ran at 1.2-1.3x plain.
    MIN_ROUNDS = 16
    LEARNING_ERRORS = 2.0  # standard errors of the acceptance above its estimate, in the learning rounds
    DECAY = 0.98  # acceptance evidence
    POSITION_PRIOR = 2.0  # trials at the pooled acceptance in each position's estimate
    COST_WEIGHT = 0.25  # weight of a new measurement in a cost's mean
    STALE_WEIGHT = 0.5  # ... in the mean of one not measured for FRESH_STEPS steps
    FRESH_STEPS = 16
    PRIOR_COST_PER_TOKEN = 0.25
    # A measurement counts for at most this many times its shape's mean (past the first ones): a step that waited for a
    # core another process held, or for the garbage collector, raises the mean by a step's share of half of it, not
    # of the 3-4x it took (on an idle 2-core Xeon, 1 in ~40 speculative steps of the demo LM took 5-8 ms against
    # ~2; one such step made a k look dear for good, since a k that looks dear is rarely measured again, and the
    # controller turned speculation off at batch 1 where it was 1.4x). A lasting change still shows in a few steps.
    OUTLIER = 1.5
    # A shape's cost starts as the lower median of its first measurements, and a bucket speculates only once its plain
    # cost has that many: the first plain step of 4 sequences on the demo LM (2-core Xeon) was measured at 2.6x the
    # decode bursts after it, and as the reference it had the controller speculate at 0.80x plain.
    FIRST_SAMPLES = 3
    CAUTION = 1.0  # standard errors added to a speculative step's measured cost
    PRIOR_ERROR = 0.3  # relative error of a cost measured once
    CATCH_UP_WEIGHT = 0.25  # of a new catch-up in the decayed sums behind a catch-up's cost
    # A decision for plain (not an exploration) stands for this many decisions of the same shape: deciding costs
    # ~30-45 us (Python), 2-3 % of a 2-sequence step of the demo LM, which a speculating engine that decodes plainly
    # would pay at every step (A/B at 2 concurrent, 9 rounds: 0.965x plain deciding every step, 0.994x with the
    # decisions skipped; docs/benchmarks.md#bench-spec-speculative-decoding).
    HOLD_PLAIN = 4

    def __init__(self, max_k: int, adaptive: bool = True) -> None:
        self.max_k = max_k
        self.adaptive = adaptive
        # Decayed (successes, trials), starting from a weak prior.
        self._evidence = {"draft": [3.5, 5.0], "ngram": [2.5, 5.0]}
        # per method, per position i: decayed (accepted, tested) of a round's i-th proposal, tested where the ones
        # before it were accepted (``position_acceptance``)
        self._positions = {m: [[0.0, 0.0] for _ in range(max(1, max_k))] for m in METHODS}
        self._rounds = dict.fromkeys(METHODS, 0)  # verification rounds recorded (``MIN_ROUNDS``)
        self._hits = {"draft": [1.0, 1.0], "ngram": [1.0, 1.0]}  # decayed (lookups that proposed, lookups)
        # decayed (tokens proposed, tokens asked for) over the lookups that proposed: an n-gram match near the end of
        # its context proposes fewer tokens than k
        self._fill = {"draft": [1.0, 1.0], "ngram": [1.0, 1.0]}
        self._costs: dict[tuple[str, int, int], _Cost] = {}  # (method or "plain", bucket, k) -> seconds a sequence
        # (method, bucket) -> [exploration budget in seconds, decisions since the last, explorations so far,
        # decisions since the last plain one]
        self._explore: dict[tuple[str, int], list[float]] = {}
        # (method, bucket) -> (the shape decided, decisions it still stands for, a step's seconds, the budget's cap)
        self._held: dict[tuple[str, int], tuple[tuple[int, int, bool], int, float, float]] = {}
        self._clock = 0
        self._catch_up = [0.0, 0.0]  # a draft's catch-ups: decayed (seconds, tokens)

    # -- evidence ----------------------------------------------------------------------------------------------
    def acceptance(self, method: str) -> float:
        successes, trials = self._evidence[method]
        return successes / trials

    def hit_rate(self, method: str) -> float:
        hits, lookups = self._hits[method]
        return hits / lookups

    def record(self, method: str, proposed: int, accepted: int) -> None:
        if proposed <= 0:
            return
        self._rounds[method] += 1
        ev = self._evidence[method]
        ev[0] = self.DECAY * ev[0] + accepted
        ev[1] = self.DECAY * ev[1] + accepted + (1 if accepted < proposed else 0)
        positions = self._positions[method]
        for i in range(min(accepted + 1, proposed, len(positions))):
            position = positions[i]
            position[0] = self.DECAY * position[0] + (1.0 if i < accepted else 0.0)
            position[1] = self.DECAY * position[1] + 1.0

    def position_acceptance(self, method: str) -> list[float]:
        """The probability that a round's i-th proposal is accepted given that the ones before it were, for i = 1 ..
        max_k: each position's own evidence beside ``POSITION_PRIOR`` trials at the pooled ``acceptance``. Acceptance
        is not one coin per token: an n-gram copy, once its first token is right, tends to stay right, and a draft's
        first guess is its surest. One pooled rate (a geometric model) over-counted the tokens a step gives: on the
        demo LM at 4-8 concurrent n-gram sequences it expected 2.10-2.89 tokens a sequence-step where the steps gave
        1.75-2.65, and speculation ran at 0.89-0.96x plain expecting to win."""
        pooled = self.acceptance(method)
        return [
            min((accepted + self.POSITION_PRIOR * pooled) / (tested + self.POSITION_PRIOR), 0.99)
            for accepted, tested in self._positions[method]
        ]

    def record_lookups(
        self, method: str, num_lookups: int, num_proposed: int, tokens_proposed: int = 0, tokens_asked: int = 0
    ) -> None:
        """``num_lookups`` sequences looked for proposals; ``num_proposed`` of them found some: ``tokens_proposed``
        of the ``tokens_asked`` for (their k each)."""
        if num_lookups <= 0:
            return
        hits = self._hits[method]
        decay = self.DECAY**num_lookups
        hits[0] = decay * hits[0] + num_proposed
        hits[1] = decay * hits[1] + num_lookups
        if tokens_asked > 0:
            fill, decay = self._fill[method], self.DECAY**num_proposed
            fill[0] = decay * fill[0] + tokens_proposed
            fill[1] = decay * fill[1] + tokens_asked

    def proposal_fill(self, method: str) -> float:
        """The share of the k tokens asked for that a lookup that finds some proposes (1 for a draft model)."""
        proposed, asked = self._fill[method]
        return proposed / asked

    def record_step(self, method: str | None, k: int, num_seqs: int, seconds: float) -> None:
        """A step of ``num_seqs`` decoding sequences took ``seconds``: plain (``method`` None or k 0), or with
        ``method`` proposing up to k tokens for its sequences (and no other method speculating)."""
        if num_seqs <= 0 or seconds <= 0:
            return
        bucket = concurrency_bucket(num_seqs)
        key = ("plain", bucket, 0) if method is None or k == 0 else (method, bucket, k)
        per_seq = seconds / num_seqs
        self._clock += 1
        cost = self._costs.get(key)
        if cost is None:
            self._costs[key] = _Cost(per_seq, self._clock, first=[per_seq])
            return
        if cost.count < self.FIRST_SAMPLES:
            cost.first.append(per_seq)
            cost.seconds, cost.variance = statistics.median_low(cost.first), statistics.pvariance(cost.first)
            cost.updated = self._clock
            cost.count += 1
            return
        # An estimate refreshed only now and then (an explored shape) is old: the new measurement weighs more.
        weight = self.COST_WEIGHT if self._clock - cost.updated <= self.FRESH_STEPS else self.STALE_WEIGHT
        per_seq = min(per_seq, cost.seconds * self.OUTLIER)
        deviation = per_seq - cost.seconds
        cost.seconds += weight * deviation
        cost.variance = (1.0 - weight) * (cost.variance + weight * deviation * deviation)
        cost.updated = self._clock
        cost.count += 1

    def record_catch_up(self, num_tokens: int, seconds: float) -> None:
        """The draft read ``num_tokens`` tokens it was behind on in ``seconds`` before proposing."""
        if num_tokens <= 0 or seconds <= 0:
            return
        decay = 1.0 - self.CATCH_UP_WEIGHT
        self._catch_up = [decay * self._catch_up[0] + seconds, decay * self._catch_up[1] + num_tokens]

    def catch_up_cost(self, num_tokens: int) -> float:
        """Seconds the draft is expected to take to read ``num_tokens`` it is behind on: the recent catch-ups'
        seconds over their tokens (a few-token catch-up's fixed cost weighs by its tokens, not as a rate of its own);
        0 before one is measured (the first one is tried, and measured)."""
        seconds, tokens = self._catch_up
        return seconds / tokens * num_tokens if tokens else 0.0

    # -- the decision ------------------------------------------------------------------------------------------
    def cost(self, method: str, num_seqs: int, k: int) -> float | None:
        """The measured seconds a sequence of a step (plain for k 0), or None where not measured."""
        bucket = concurrency_bucket(num_seqs)
        c = self._costs.get(("plain", bucket, 0) if k == 0 else (method, bucket, k))
        return c.seconds if c is not None else None

    def estimated_cost(self, method: str, num_seqs: int, k: int, plain: float) -> float:
        """The measured cost of k, or one extrapolated from the ks measured ``FIRST_SAMPLES`` times (``_extrapolated``;
        before any, the prior); for a measured k raised by ``CAUTION`` standard errors (its own and plain's):
        speculation is chosen on evidence, so a measurement that noise made look cheap (or plain's
        look dear) does not switch it on by itself. A k measured fewer times than ``FIRST_SAMPLES`` costs the lower
        of its measurements and the extrapolation: it is tried again before one slow step (a stall, a first call)
        prices it, or the k beyond it, out for good."""
        if k == 0:
            return plain
        bucket = concurrency_bucket(num_seqs)
        plain_error = self._costs[("plain", bucket, 0)].relative_error(self.COST_WEIGHT, self.PRIOR_ERROR)
        measured = self._costs.get((method, bucket, k))
        own = None
        if measured is not None:
            error = measured.relative_error(self.COST_WEIGHT, self.PRIOR_ERROR)
            own = measured.seconds * (1.0 + self.CAUTION * (error**2 + plain_error**2) ** 0.5)
            if measured.count >= self.FIRST_SAMPLES:
                return own
        settled = self._settled(method, bucket)  # (k is not among them: it returned above)
        if settled:
            points = {j: self.estimated_cost(method, num_seqs, j, plain) for j in settled}
            guess = self._extrapolated(k, points, plain)
            return guess if own is None else min(own, guess)
        return own if own is not None else plain * (1.0 + self.prior_cost_per_token(method, bucket) * k)

    def _extrapolated(self, k: int, points: dict[int, float], plain: float) -> float:
        """The cost of k from the settled ks' (``points``) and plain's (k = 0): between two, on the line joining
        them; past the largest, along the line through the two largest (not falling), or with one settled k, at
        ``PRIOR_COST_PER_TOKEN`` of a plain step a further proposal, or half what one added on average, if more. A
        speculative step has a fixed part (the verification's and the bookkeeping's: on the demo LM at batch 1 a k = 1
        step cost ~1.7 ms against a plain 0.9, k = 6 ~3); a line from plain through one small k charged that part
        to every proposal and priced the long k that win at batch 1 twice over (k = 6 at 6 ms)."""
        below = max((j for j in points if j < k), default=0)
        above = min((j for j in points if j > k), default=None)
        low = points[below] if below else plain
        if above is not None:
            return low + (points[above] - low) * (k - below) / (above - below)
        largest = sorted(points)[-2:]
        if len(largest) == 2:
            slope = max(0.0, (points[largest[1]] - points[largest[0]]) / (largest[1] - largest[0]))
        else:
            slope = max(self.PRIOR_COST_PER_TOKEN * plain, 0.5 * max(0.0, low - plain) / below)
        return low + slope * (k - below)

    def _settled(self, method: str, bucket: int) -> list[int]:
        """The k measured ``FIRST_SAMPLES`` times or more in ``bucket``."""
        return [
            j
            for j in range(1, self.max_k + 1)
            if (cost := self._costs.get((method, bucket, j))) is not None and cost.count >= self.FIRST_SAMPLES
        ]

    def prior_cost_per_token(self, method: str, bucket: int) -> float:
        """What a proposal is assumed to add to a step of ``bucket`` sequences, in plain steps, before any k is
        measured there: at least ``PRIOR_COST_PER_TOKEN``, and at least what one added in the nearest smaller bucket
        measured (its k's ratios, each weighed by the steps it was measured on: one step a noisy host made dear, never
        measured again, does not stand for the bucket). A step's rows cost more, relative to its weights, the larger
        the batch (the weights are read once a step, every row is computed), so the ratio measured at a smaller batch
        is a floor for a larger one: the first steps of a large batch do not try a k that smaller batches showed to
        lose."""
        b = max(
            (b for (m, b, k) in self._costs if m == method and k > 0 and b < bucket and ("plain", b, 0) in self._costs),
            default=None,
        )
        if b is None:
            return self.PRIOR_COST_PER_TOKEN
        plain = self._costs[("plain", b, 0)].seconds
        measured = [
            (self._costs[(method, b, j)].count, (self._costs[(method, b, j)].seconds / plain - 1.0) / j)
            for j in range(1, self.max_k + 1)
            if (method, b, j) in self._costs
        ]
        ratio = sum(n * r for n, r in measured) / sum(n for n, _ in measured)
        return max(self.PRIOR_COST_PER_TOKEN, ratio)

    def tokens_per_seq(self, method: str, k: int) -> float:
        """Expected tokens a sequence gets from a step with k proposals planned."""
        if k == 0:
            return 1.0
        hit, fill = self.hit_rate(method), self.proposal_fill(method)
        return hit * position_tokens(self.position_acceptance(method), max(1.0, k * fill)) + (1.0 - hit)

    def estimates(self, method: str, num_seqs: int, num_decoding: int) -> list[tuple[float, float]] | None:
        """Expected (tokens, seconds) of the step for k = 0 .. max_k, with ``num_seqs`` of the ``num_decoding``
        decoding sequences speculating with ``method``; None before the bucket's plain step is measured
        ``FIRST_SAMPLES`` times."""
        reference = self._costs.get(("plain", concurrency_bucket(num_decoding), 0))
        if reference is None or reference.count < self.FIRST_SAMPLES:
            return None
        plain = reference.seconds
        # ``estimated_cost`` and ``tokens_per_seq`` for every k in one pass (the engine asks every step: on the demo
        # LM at 2 concurrent, k by k made ``choose_k`` 37 us of a ~1.8 ms step; one pass, 15 us).
        bucket = concurrency_bucket(num_decoding)
        plain_error = self._costs[("plain", bucket, 0)].relative_error(self.COST_WEIGHT, self.PRIOR_ERROR)
        measured: dict[int, float] = {}
        for j in range(1, self.max_k + 1):
            cost = self._costs.get((method, bucket, j))
            if cost is not None:
                error = cost.relative_error(self.COST_WEIGHT, self.PRIOR_ERROR)
                measured[j] = cost.seconds * (1.0 + self.CAUTION * (error**2 + plain_error**2) ** 0.5)
        settled = self._settled(method, bucket)
        points = {j: measured[j] for j in settled}
        prior = self.prior_cost_per_token(method, bucket) if not settled else 0.0
        hit, alphas, fill = self.hit_rate(method), self.position_acceptance(method), self.proposal_fill(method)
        others = num_decoding - num_seqs
        rows = [(float(num_decoding), num_decoding * plain)]
        for k in range(1, self.max_k + 1):
            if k in settled:
                seconds = measured[k]
            elif settled:
                seconds = self._extrapolated(k, points, plain)
                if k in measured:
                    seconds = min(seconds, measured[k])
            elif k in measured:
                seconds = measured[k]
            else:
                seconds = plain * (1.0 + prior * k)
            tokens = hit * position_tokens(alphas, max(1.0, k * fill)) + (1.0 - hit)
            rows.append((others + num_seqs * tokens, num_decoding * seconds))
        return rows

    def _optimistic_k(
        self, method: str, estimates: list[tuple[float, float]], known: list[int], num_seqs: int, num_decoding: int
    ) -> int:
        """The k that would give ``MIN_GAIN`` times plain's rate, or most over it, were the acceptance
        ``LEARNING_ERRORS`` standard errors (of its evidence's trials) above its estimate; 0 if none would."""
        successes, trials = self._evidence[method]
        alpha = successes / trials
        upper = min(0.99, alpha + self.LEARNING_ERRORS * (alpha * (1.0 - alpha) / trials) ** 0.5)
        hit, fill = self.hit_rate(method), self.proposal_fill(method)
        best, best_rate = 0, self.MIN_GAIN * estimates[0][0] / estimates[0][1]
        for k in known:
            tokens = num_decoding - num_seqs + num_seqs * (hit * expected_tokens(upper, max(1.0, k * fill)) + 1.0 - hit)
            if tokens / estimates[k][1] > best_rate:
                best, best_rate = k, tokens / estimates[k][1]
        return best

    def holds_plain(self, method: str, num_seqs: int, num_decoding: int | None = None, measured: bool = True) -> bool:
        """Whether a plain decision made a step or a few ago (``HOLD_PLAIN``) stands for this step, of the same shape:
        then this step is plain, and counted as one it stood for (``choose_k`` returns 0 for it). The engine asks
        first, and skips what ``choose_k`` needs of every sequence (its catch-up and horizon): at 64 concurrent
        sequences that was ~0.3 ms a step. False leaves nothing held for the step: ask ``choose_k`` then."""
        if not self.adaptive:
            return False
        num_decoding = max(num_seqs, num_decoding or 0)
        bucket = concurrency_bucket(num_decoding)
        shape = (num_seqs, num_decoding, measured)
        held = self._held.pop((method, bucket), None)
        if held is None or held[0] != shape or held[1] <= 0:
            return False
        # Plain, as decided a step or a few ago: the exploration budget grows as that decision would have it.
        self._held[(method, bucket)] = (shape, held[1] - 1, held[2], held[3])
        state = self._explore.setdefault((method, bucket), [0.0, 0.0, 0.0, 0.0])
        state[0] = min(state[0] + self.EXPLORE_SHARE * held[2], held[3])
        state[1] += 1
        return True

    def choose_k(
        self,
        method: str,
        num_seqs: int,
        num_decoding: int | None = None,
        measured: bool = True,
        catch_up_tokens: int = 0,
        horizon_tokens: float = float("inf"),
    ) -> int:
        """k for the ``num_seqs`` sequences speculating with ``method`` this step, among ``num_decoding`` decoding
        sequences in all (default: only them). ``measured``: whether this step's cost will be recorded (it decodes
        only). A step that will not be (prompt tokens in it) takes a k only where that k's cost is measured in the
        bucket, and never explores: an untried k taken there would not be learnt from, and the step would take it
        again, as each step of a batch's prefill did. ``catch_up_tokens``: what the draft must read before it can
        propose for these sequences; ``horizon_tokens``: the tokens they may still produce, all told (their
        ``max_tokens`` left). Speculation that needs a catch-up is chosen only where what it is expected to save over
        that horizon pays for it."""
        if not self.adaptive:
            return self.max_k
        if self.holds_plain(method, num_seqs, num_decoding, measured):
            return 0
        num_decoding = max(num_seqs, num_decoding or 0)
        bucket = concurrency_bucket(num_decoding)
        shape = (num_seqs, num_decoding, measured)
        estimates = self.estimates(method, num_seqs, num_decoding)
        if estimates is None:
            return 0
        rates = [tokens / seconds for tokens, seconds in estimates]
        known = [k for k in range(1, self.max_k + 1) if measured or (method, bucket, k) in self._costs]
        best = max(known, key=lambda k: rates[k], default=0)
        if best and rates[best] < self.MIN_GAIN * rates[0]:
            best = 0
        learning = False
        if not best and measured and self._rounds[method] < self.MIN_ROUNDS:
            best = self._optimistic_k(method, estimates, known, num_seqs, num_decoding)
            learning = best > 0
        catch_up = self.catch_up_cost(catch_up_tokens)
        if best and catch_up > horizon_tokens * (1.0 / rates[0] - 1.0 / rates[best]) and not learning:
            best = 0  # the steps left would not save what the draft's catch-up costs
        if self.max_k < 1 or not measured:
            return best
        # Exploring: while plain wins, the best speculative k; while speculation wins, plain (the reference) and
        # the runner-up k in turn. Each decision adds EXPLORE_SHARE of a step's time to a budget; an exploration
        # spends what it is expected to lose (its time beyond what its tokens would take at the best rate).
        state = self._explore.setdefault((method, bucket), [0.0, 0.0, 0.0, 0.0])
        budget, since, turns, since_plain = state
        plain_count = self._costs[("plain", bucket, 0)].count
        plain_every = self.PLAIN_EVERY if plain_count >= self.PLAIN_SETTLED else self.PLAIN_EVERY_EARLY
        if best and since_plain + 1 >= plain_every:
            # Plain, the reference, is re-measured at a fixed rate while speculation wins: it can cost speculation
            # some of its gain, never speed against plain decoding; a stale reference could. (Counted apart from the
            # explorations: counted with them, an exploration every MIN_EXPLORE_GAP decisions kept plain from ever
            # coming, and at 4 concurrent a first plain step slower than the decode bursts after it stood as the
            # reference for good: speculation ran at 0.82x plain, "expected" to win.)
            budget = min(budget + self.EXPLORE_SHARE * estimates[best][1], self.MAX_SAVED_STEPS * estimates[best][1])
            state[:] = [budget, since, turns, 0.0]
            return 0
        since += 1
        since_plain += 1
        others = [k for k in range(1, self.max_k + 1) if k != best]
        candidate = max(others, key=lambda k: rates[k], default=best)
        loss = max(0.0, estimates[candidate][1] * (1.0 - rates[candidate] / rates[best]))
        if candidate and not best:
            loss += catch_up  # the draft reads what it is behind on first
        # (What goes unspent while nothing is worth exploring is not spent in a burst later: at most MAX_SAVED_STEPS
        # steps' time is saved, or one exploration's cost where a catch-up makes it dearer than that.)
        cap = max(self.MAX_SAVED_STEPS * estimates[best][1], loss)
        budget = min(budget + self.EXPLORE_SHARE * estimates[best][1], cap)
        if candidate != best and since >= self.MIN_EXPLORE_GAP and budget >= loss:
            state[:] = [budget - loss, 0.0, turns + 1, since_plain]
            return candidate
        state[:] = [budget, since, turns, since_plain]
        if not best and self.HOLD_PLAIN > 1:
            self._held[(method, bucket)] = (shape, self.HOLD_PLAIN - 1, estimates[0][1], cap)
        return best


class DraftProposer:
    """Runs the draft model k steps ahead for a batch of sequences; the draft shares the target's block
    tables (same block ids, its own KV tensors) and catches up on tokens it has not seen."""

    # A draft behind its sequence by more than this many tokens (its prompt, tokens decoded while speculation was
    # off) catches up in a forward of its own first.
    MAX_LAG = 2

    def __init__(self, runner: ModelRunner, sampler: Sampler, clock: Callable[[], float] = time.perf_counter) -> None:
        self.runner = runner
        # The draft's forwards run on one thread unless large (64 prompts to catch up on): a parallel torch forward
        # hands work to the other threads at every op, and on a busy host each hand-off can wait milliseconds for
        # a core (a 128-token catch-up of the demo draft took 300 ms on two threads, 20 on one).
        runner.parallel_min_macs = 16 * PARALLEL_MIN_MACS
        self.sampler = sampler
        self.clock = clock  # the engine's step clock (``LLMEngine.step_clock``)
        self.catch_up_seconds = 0.0  # of the last ``propose``: its catch-up's time and tokens
        self.catch_up_tokens = 0

    @classmethod
    def lag(cls, seq: Sequence) -> int:
        """The tokens the draft must read first, in a catch-up, before it proposes for ``seq`` (0 when it is at most
        ``MAX_LAG`` behind: those it reads in its first proposing step)."""
        behind = seq.num_tokens - seq.draft_num_computed_tokens
        return behind - 1 if behind > cls.MAX_LAG else 0

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence]) -> dict[int, torch.Tensor | None]:
        """Fill ``seq.spec_token_ids`` (``seq.num_lookahead`` tokens); returns draft probs [k, V] per
        sampled sequence (None for greedy ones)."""
        self.catch_up_seconds, self.catch_up_tokens = 0.0, 0
        lagging = [s for s in seqs if self.lag(s)]
        if lagging:
            # A one-off, not what a round of k proposals costs: the controller prices it apart
            # (``SpecController.record_catch_up``), and the step's cost is recorded without it.
            started = self.clock()
            self.runner.execute(
                [
                    Feed(s.block_table, s.token_ids[s.draft_num_computed_tokens : -1], s.draft_num_computed_tokens, 0)
                    for s in lagging
                ]
            )
            self.catch_up_seconds = self.clock() - started
            self.catch_up_tokens = sum(self.lag(s) for s in lagging)
            for s in lagging:
                s.draft_num_computed_tokens = s.num_tokens - 1
        probs: dict[int, list[torch.Tensor]] = {s.seq_id: [] for s in seqs}
        feeds = [
            Feed(s.block_table, s.token_ids[s.draft_num_computed_tokens :], s.draft_num_computed_tokens, 1)
            for s in seqs
        ]
        for seq in seqs:
            seq.spec_token_ids = []
        if all(s.params.is_greedy for s in seqs):
            # Greedy proposals: every draft step in one fused call where the draft's runner has it.
            proposals = self.runner.propose_greedy(feeds, [s.num_lookahead for s in seqs])
            if proposals is not None:
                for seq, tokens in zip(seqs, proposals, strict=True):
                    seq.spec_token_ids = tokens
                    seq.draft_num_computed_tokens = seq.num_tokens + len(tokens) - 1
                return {s.seq_id: None for s in seqs}
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
