"""The step loop: schedule → run (propose, the model, sample or verify) → postprocess (append tokens, finish, fork).

The step produces token ids (``EngineCoreOutputs``); ``OutputProcessor`` turns them into text after the step, here
(``step``) or in the API process (``EngineProcess`` runs ``step_core`` in a process of its own)."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from cloud.engine.block_manager import BlockManager
from cloud.engine.config import EngineConfig
from cloud.engine.loader import resolve_dtype
from cloud.engine.model_config import ModelConfig
from cloud.engine.model_runner import Feed, ModelRunner, set_process_threads
from cloud.engine.output_processor import OutputProcessor
from cloud.engine.outputs import RequestOutput
from cloud.engine.prompts import check_context_length, encode_prompt
from cloud.engine.protocol import AddRequest, EngineCoreOutput, EngineCoreOutputs, SequenceOutput
from cloud.engine.sampler import GrammarMasks, Sampler
from cloud.engine.sampling_params import SamplingParams
from cloud.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from cloud.engine.sequence import FinishReason, Sequence
from cloud.engine.speculator import DraftProposer, SpecController, ngram_proposal
from cloud.engine.tokenizer import ChatTokenizer
from shared.errors import ConfigurationError, ValidationError
from shared.structured import GrammarTokenizer

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Request:
    request_id: str
    seqs: list[Sequence]
    pending_siblings: list[Sequence]


@dataclass(slots=True)
class _Work:
    """One scheduled sequence's part of a step: what it feeds the model and the tokens it gets."""

    seq: Sequence
    start: int  # tokens computed before the step
    num_base: int  # tokens fed that are not proposals
    spec: list[int]  # proposals to verify
    feed: Feed
    row: int  # its first sampling row of the step's logits
    samples: bool  # it reaches its last token: the step gives it new tokens (its rows from ``row`` on)
    num_lookahead: int = 0  # proposal slots it was scheduled with (more than ``spec`` when a grammar cut them)
    # Prompt logprobs: rows ``row - num_prompt_rows .. row`` are the logits of prompt positions ``prompt_pos ..``.
    prompt_pos: int = 0
    num_prompt_rows: int = 0
    new_token_ids: list[int] = field(default_factory=list)
    burst: bool = False  # its tokens came from a decode burst (``LLMEngine._run_burst``), not from logits


@dataclass(slots=True)
class EngineStats:
    num_steps: int = 0
    num_generated_tokens: int = 0
    num_prompt_tokens_computed: int = 0
    num_preemptions: int = 0
    spec_proposed: dict[str, int] = field(default_factory=dict)
    spec_accepted: dict[str, int] = field(default_factory=dict)
    spec_steps: dict[str, int] = field(default_factory=dict)  # steps in which a method proposed (k > 0)
    draft_catch_up_tokens: int = 0  # tokens the draft read before proposing, in catch-ups
    decode_bursts: int = 0  # steps that decoded several tokens a sequence in one fused call


def available_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 4 << 30


class LLMEngine:
    """One model (plus an optional draft) behind a continuous-batching step loop. Not thread-safe: one
    thread calls ``add_request`` / ``abort_request`` / ``step`` (``AsyncLLMEngine`` provides that thread)."""

    def __init__(self, config: EngineConfig, process_outputs: bool = True) -> None:
        """Load the model (and draft). ``process_outputs=False``: a core only (``step_core``), whose outputs are
        turned into text elsewhere (``EngineProcess`` does so in the API process)."""
        self.config = config
        if config.num_threads:
            set_process_threads(config.num_threads)
        self.device = torch.device(config.device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigurationError("device 'cuda' requested but torch sees no CUDA device")
        model_config = ModelConfig.from_dir(config.model_dir)
        self.model_config = model_config
        self.tokenizer = ChatTokenizer(config.model_dir)
        self.max_model_len = min(config.max_model_len or model_config.max_position_embeddings, 1 << 20)
        dtype = resolve_dtype(model_config, self.device, config.dtype)
        self.dtype = dtype
        self.num_blocks = self._num_kv_blocks()

        def runner(model_dir: Path, weights: str) -> ModelRunner:  # the target and its draft share the KV geometry
            return ModelRunner(
                model_dir,
                self.device,
                dtype,
                config.block_size,
                self.num_blocks,
                self.max_model_len,
                fused_decode=config.fused_decode,
                int8_weights=weights == "int8",
                cuda_graphs=not config.enforce_eager,
                max_num_seqs=config.max_num_seqs,
            )

        self.runner = runner(config.model_dir, config.cpu_weights)
        draft_dir = config.draft_model_dir
        draft_weights = config.draft_cpu_weights if self.device.type == "cpu" else "fp32"  # a CPU layout only
        self.draft_runner = runner(draft_dir, draft_weights) if draft_dir is not None else None
        self.sampler = Sampler(self.device)
        self.block_manager = BlockManager(self.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_num_queued_requests=config.max_num_queued_requests,
                max_num_queued_tokens=config.max_num_queued_tokens,
            ),
            self.block_manager,
        )
        self.eos_token_ids = set(model_config.eos_token_ids)
        self.grammar_tokenizer: GrammarTokenizer | None = None  # built on the first structured request
        # What the speculation controller times steps with. On CPU this thread's CPU time: what a step computes,
        # not how long the host's other load kept it off a core (wall time on a busy host is mostly that, and
        # varies tenfold between identical steps); on an idle host the two agree (OpenMP's workers run beside
        # this thread, which waits for them spinning). On an accelerator the wall clock (the host thread waits).
        self.step_clock: Callable[[], float] = time.thread_time if self.device.type == "cpu" else time.perf_counter
        self.drafter = (
            DraftProposer(self.draft_runner, self.sampler, self.step_clock) if self.draft_runner is not None else None
        )
        self.spec = self._spec_controller()
        self._step_plan: dict[str, int] = {}  # the k each speculating method was given this step
        self._burst = 0  # tokens a sequence this step decodes in one fused call (0: not a burst step)
        # The controller's record of the last step, filed at the next step's start with what the caller did between
        # the two (``_file_step``); and the requests added so far (an admission between them is not the step's cost).
        self._step_record: tuple[str | None, int, int, float, float, int, int] | None = None
        self._num_added = 0
        self._prompt_step = False  # the last step timed had prompt tokens (``_record_step``)
        self._token_seconds: float | None = None  # a decode step's wall seconds a token a sequence, averaged
        self._no_logits = torch.empty(0)
        self._requests: dict[str, _Request] = {}
        self.output_processor = OutputProcessor(self.tokenizer, config.stream_interval) if process_outputs else None
        self._seq_ids = itertools.count()
        self.stats = EngineStats()
        if self.spec is not None and self.spec.adaptive and config.warm_up:
            self._warm_up()
        logger.info(
            "engine ready: %s (%s, %s), %d KV blocks of %d tokens, speculation %s",
            config.model_dir.name,
            self.device,
            str(dtype).removeprefix("torch."),
            self.num_blocks,
            config.block_size,
            config.speculation,
        )

    @torch.inference_mode()
    def _warm_up(self) -> None:
        """Run each forward path of the target and the draft once before serving (as ``llama-server`` does): a first
        call pays one-off costs (code loaded, buffers allocated, packed weights touched), ten times a step's, and the
        speculation controller would take them for what a step or a catch-up costs here — speculation then looked
        dear, and staying plain kept it from being measured again. The forwards write KV blocks no sequence holds
        yet (each position is written before it is read); nothing else is kept."""
        block = self.config.block_size
        prompt = min(2 * block, self.max_model_len - self.config.num_speculative_tokens - 2)
        if prompt < 1:
            return
        per_seq = -(-(prompt + self.config.num_speculative_tokens + 1) // block)
        num_seqs = max(1, min(16, self.config.max_num_seqs, self.num_blocks // per_seq))
        tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(num_seqs)]
        token = min(self.eos_token_ids, default=0)
        verify = self.config.num_speculative_tokens + 1
        for runner in (self.runner, self.draft_runner):
            if runner is None:
                continue
            runner.execute([Feed(t, [token] * prompt, 0, 1) for t in tables[:2]])  # prefill, a catch-up
            runner.execute([Feed(tables[0], [token], prompt, 1)])  # a decode step alone (fused on CPU)
            runner.execute([Feed(t, [token], prompt, 1) for t in tables])  # a batch's
            runner.execute([Feed(tables[0], [token] * verify, prompt, verify)])  # a verification

    def _num_kv_blocks(self) -> int:
        """As many blocks (of the model's K/V and the draft's) as the budget holds; at least one max-length
        sequence's."""
        config, model_config = self.config, self.model_config
        block_bytes = ModelRunner.kv_bytes_per_block(model_config, config.block_size, self.dtype)
        draft_config = ModelConfig.from_dir(config.draft_model_dir) if config.draft_model_dir else None
        if draft_config is not None:
            if draft_config.vocab_size != model_config.vocab_size:
                raise ConfigurationError(
                    f"draft vocab_size {draft_config.vocab_size} differs from the model's {model_config.vocab_size}"
                )
            block_bytes += ModelRunner.kv_bytes_per_block(draft_config, config.block_size, self.dtype)
        budget = config.kv_cache_bytes or int(available_memory_bytes(self.device) * config.kv_cache_fraction)
        num_blocks = budget // block_bytes
        min_blocks = -(-self.max_model_len // config.block_size) + 1
        if num_blocks < min_blocks:
            raise ConfigurationError(
                f"KV budget of {budget} bytes holds {num_blocks} blocks; one max-length sequence needs {min_blocks}"
            )
        return int(num_blocks)

    def _spec_controller(self) -> SpecController | None:
        config = self.config
        if config.speculation == "off" and self.draft_runner is None:
            return None
        return SpecController(config.num_speculative_tokens, adaptive=config.adaptive_speculation)

    # -- requests -----------------------------------------------------------------------------------------------
    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        return encode_prompt(self.tokenizer, self.model_config.vocab_size, prompt)

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        priority: int = 0,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
    ) -> None:
        """Validate and queue one request. Raises ValidationError (too long, bad params) or QueueFull."""
        now = arrival_time if arrival_time is not None else time.monotonic()
        self.add(AddRequest(request_id, self.encode_prompt(prompt), params, priority, cache_salt, now))

    def add(self, request: AddRequest) -> None:
        """``add_request`` with the request as it crosses the engine's boundary."""
        self.add_core_request(request)
        if self.output_processor is not None:
            self.output_processor.add_request(request)

    def add_core_request(self, request: AddRequest) -> None:
        """Queue a request in the core (its outputs are token ids); raises as ``add_request``."""
        request_id, prompt_ids, params = request.request_id, request.prompt_token_ids, request.params
        self._num_added += 1
        if request_id in self._requests:
            raise ValidationError(f"request id {request_id!r} is already in flight", param="request_id")
        self.encode_prompt(prompt_ids)  # ids from another process are checked against the vocabulary too
        max_tokens = check_context_length(len(prompt_ids), params.max_tokens, self.max_model_len)
        seqs = [
            Sequence(
                seq_id=next(self._seq_ids),
                request_id=request_id,
                token_ids=list(prompt_ids),
                num_prompt_tokens=len(prompt_ids),
                params=params,
                arrival_time=request.arrival_time,
                priority=request.priority,
                cache_salt=request.cache_salt,
                max_tokens=max_tokens,
                sibling_index=i,
            )
            for i in range(params.n)
        ]
        if params.grammar is not None:  # one matcher per sequence (n > 1: each sibling follows its own path)
            grammar_tokenizer = self._grammar_tokenizer()
            grammar_tokenizer.check(params.grammar)
            for seq in seqs:
                seq.constraint = grammar_tokenizer.constraint(params.grammar)
        self.scheduler.add(seqs[:1])
        self._requests[request_id] = _Request(request_id, seqs, seqs[1:])

    def _grammar_tokenizer(self) -> GrammarTokenizer:
        if self.grammar_tokenizer is None:
            self.grammar_tokenizer = GrammarTokenizer(
                self.tokenizer, self.model_config.vocab_size, self.model_config.eos_token_ids
            )
        return self.grammar_tokenizer

    def abort_request(self, request_id: str) -> None:
        """Stop a request and free its blocks at once (unknown or finished ids are ignored)."""
        if self.output_processor is not None:
            self.output_processor.abort_request(request_id)
        req = self._requests.pop(request_id, None)
        if req is None:
            return
        for seq in req.seqs:
            self.scheduler.finish(seq, FinishReason.ABORT)
            self.sampler.release(seq)

    def abort_all(self) -> list[str]:
        """Abort every request in flight (after a failed step); their ids."""
        ids = list(self._requests)
        for rid in ids:
            self.abort_request(rid)
        return ids

    def stop_sequences(self, sequences: Iterable[tuple[str, int]]) -> None:
        """Finish outputs (request id, index) that a stop string ended, and free their blocks."""
        for request_id, index in sequences:
            req = self._requests.get(request_id)
            if req is None:
                continue
            seq = req.seqs[index]
            self.scheduler.finish(seq, FinishReason.STOP)
            self.sampler.release(seq)
            if all(s.is_finished for s in req.seqs):
                del self._requests[request_id]

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._requests)

    # -- the step -----------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns an update for every request that progressed or finished (detokenised,
        stop strings applied, held back to the stream interval)."""
        if self.output_processor is None:
            raise RuntimeError("this engine is a core only (process_outputs=False): call step_core")
        processed = self.output_processor.process(self.step_core())
        self.stop_sequences(processed.stopped)
        return processed.outputs

    def step_core(self) -> EngineCoreOutputs:
        """One step of model work: schedule → run → postprocess. Token ids out, no text."""
        started, wall = self.step_clock(), time.perf_counter()
        self._file_step(started)
        batch = self._schedule()
        outputs: list[EngineCoreOutput] = []
        token_time = time.monotonic()
        if batch.scheduled:
            works, logits = self._run(batch)
            token_time = time.monotonic()
            outputs = self._postprocess(works, logits)
            ended = self.step_clock()
            self._record_step(batch, ended - started, ended)
            self._time_decode(works, time.perf_counter() - wall)
        self.stats.num_steps += 1
        return EngineCoreOutputs(outputs, token_time, time.monotonic())

    def _schedule(self) -> SchedulerOutput:
        self._plan_speculation()
        self._plan_burst()
        batch = self.scheduler.schedule()
        self.stats.num_preemptions = self.scheduler.num_preemptions
        return batch

    def _plan_speculation(self) -> None:
        self._step_plan = {}
        if self.spec is None:
            return
        by_method: dict[str, list[Sequence]] = {"draft": [], "ngram": []}
        num_decoding = 0
        # A step with prompt tokens (a sequence prefilling, or one the scheduler has room to admit) is not of a shape
        # the controller measures: it speculates there only with a k already measured.
        scheduler = self.scheduler
        measured = not (scheduler.waiting and len(scheduler.running) < scheduler.config.max_num_seqs)
        for seq in self.scheduler.running:
            seq.num_lookahead = 0
            method = seq.params.speculation or self.config.speculation or "off"
            if seq.num_uncomputed_tokens != 1:
                measured = False
                continue
            num_decoding += 1
            # Penalties depend on every accepted token, and a seeded sampled request must draw the same random
            # numbers whatever the load (speculation would consume them differently): both decode plainly.
            seeded_sampling = seq.params.seed is not None and not seq.params.is_greedy
            if (
                method == "off"
                or seq.params.has_penalties
                or seeded_sampling
                or (method == "draft" and self.drafter is None)
            ):
                continue
            seq.spec_method = method
            by_method[method].append(seq)
        measured = measured and not (by_method["draft"] and by_method["ngram"])  # (two methods: not measured either)
        for method, seqs in by_method.items():
            if seqs:
                self._step_plan[method] = self._plan_lookahead(method, seqs, num_decoding, measured)

    def _plan_burst(self) -> None:
        """A decode burst (``EngineConfig.decode_burst_ms``) where every running sequence may take one and nothing
        waits: lookahead slots for the burst's tokens after the first (as many as the time budget allows at the
        measured time a token; none before a decode step was timed). The budget is for the tokens after the first:
        a request arriving during a burst waits for one step anyway. Counting the first in it made the burst of a step
        near half the budget 1 token or 2 by a hair (demo LM, 8 concurrent, a step 3.3-5.2 ms: 0 or ~100 bursts a
        sample, 1,148-1,775 tok/s for identical engines); now 2 there, and 2 at 16 (alternating processes: 8
        concurrent 1,624-1,775 against 1,420-1,507 tok/s where the old sizing did not burst, 16 concurrent +8 %)."""
        self._burst = 0
        config, running = self.config, self.scheduler.running
        if self.spec is None:  # (otherwise ``_plan_speculation`` did)
            for seq in running:
                seq.num_lookahead = 0
        if config.decode_burst_ms <= 0 or self._token_seconds is None or self.scheduler.waiting or not running:
            return
        fused = self.runner.fused_decoder
        if fused is None or fused.greedy_fn is None or not all(self._bursts(seq) for seq in running):
            return
        n = min(config.max_decode_burst, 1 + int(config.decode_burst_ms / 1000.0 / self._token_seconds))
        if n < 2:
            return
        for seq in running:
            room = min(seq.max_tokens - seq.num_output_tokens, self.max_model_len - seq.num_tokens)
            seq.num_lookahead = max(0, min(n, room) - 1)
        self._burst = n

    def _bursts(self, seq: Sequence) -> bool:
        """Whether ``seq``'s next tokens may come from a burst: it decodes, greedily, not speculating this step
        (speculation off, or its method's controller chose a plain step), and nothing but the argmax of its logits
        decides a token (no penalties, grammar or logprobs), and no stop string could end it mid-burst (its tokens
        past the stop would be counted)."""
        p = seq.params
        method = p.speculation or self.config.speculation or "off"
        return (
            seq.num_uncomputed_tokens == 1
            and seq.num_lookahead == 0
            and (method == "off" or self._step_plan.get(method, 0) == 0)
            and p.is_greedy
            and not p.has_penalties
            and p.logprobs is None
            and p.grammar is None
            and seq.constraint is None
            and not p.stop
            and not seq.needs_prompt_logits
        )

    def _time_decode(self, works: list[_Work], seconds: float) -> None:
        """Average a step's wall time a token a sequence, over steps where every sequence decoded without
        speculating (plain steps and bursts): what sizes a burst."""
        if any(w.num_base != 1 or w.spec or not w.samples for w in works):
            return
        per_token = seconds / (self._burst or 1)
        previous = self._token_seconds
        if previous is not None:
            # (a step that waited for a core, or for the collector, counts for at most 1.5x the mean: at 3-4x it
            # shortened the bursts after it, which then cost more a token)
            per_token = min(per_token, 1.5 * previous)
        self._token_seconds = per_token if previous is None else previous + 0.25 * (per_token - previous)

    def _plan_lookahead(self, method: str, seqs: list[Sequence], num_decoding: int, measured: bool) -> int:
        """Proposal slots for ``seqs`` (n-gram proposals looked up now); the k the controller chose."""
        assert self.spec is not None
        if self.spec.holds_plain(method, len(seqs), num_decoding, measured):
            return 0  # (the sequences' lookahead is 0 already)
        rooms = [min(seq.max_tokens - seq.num_output_tokens, self.max_model_len - seq.num_tokens) - 1 for seq in seqs]
        catch_up = sum(DraftProposer.lag(seq) for seq in seqs) if method == "draft" else 0
        k = self.spec.choose_k(method, len(seqs), num_decoding, measured, catch_up, sum(rooms) + len(seqs))
        if k:
            self.stats.spec_steps[method] = self.stats.spec_steps.get(method, 0) + 1
        num_lookups = num_found = proposed = asked = 0
        for seq, room in zip(seqs, rooms, strict=True):
            look = max(0, min(k, room))
            if method == "ngram" and look:
                seq.spec_token_ids = ngram_proposal(seq.token_ids, look)
                num_lookups += 1
                if seq.spec_token_ids:
                    num_found += 1
                    proposed += len(seq.spec_token_ids)
                    asked += look
                look = len(seq.spec_token_ids)
            seq.num_lookahead = look
        self.spec.record_lookups(method, num_lookups, num_found, proposed, asked)
        return k

    def _record_step(self, batch: SchedulerOutput, seconds: float, ended: float) -> None:
        """Keep what a step of decoding sequences only cost (plain, or one method speculating) for the controller;
        steps with prompt tokens, preemptions or two methods speculating are not of a shape it compares. Filed at the
        next step's start (``_file_step``); ``ended``: the step's end on ``step_clock``."""
        self._step_record = None
        if self.spec is None or not self.spec.adaptive:
            return
        after_prompt, self._prompt_step = self._prompt_step, False
        if not self._burst and any(item.num_new_tokens != 1 + item.num_lookahead for item in batch.scheduled):
            self._prompt_step = True
            return
        if after_prompt:
            # The first decode step after prompt tokens went through the model costs 1.5-3x the ones after it (on the
            # demo LM at 8 concurrent, 9-15 ms against ~5, the prefill's torch forward just before it); every batch
            # has one, plain or not, and as plain's reference it had n-gram speculation run at 0.88x plain at 8
            # concurrent, "expected" to win.
            return
        n = len(batch.scheduled)
        if self._burst:  # plain decoding as it runs now: its seconds a token, the unit of a plain step's cost
            self._step_record = (None, 0, n, seconds, ended, self._num_added, self._burst)
            return
        speculating = [(m, k) for m, k in self._step_plan.items() if k > 0]
        if len(speculating) > 1:
            return
        method, k = speculating[0] if speculating else (None, 0)
        catch_up = self.drafter.catch_up_seconds if self.drafter is not None and method == "draft" else 0.0
        # (the catch-up: priced apart)
        self._step_record = (method, k, n, seconds - catch_up, ended, self._num_added, 1)

    def _file_step(self, now: float) -> None:
        """File the last step's record with the controller, its cost counting what its caller did before this step
        (``now``, on ``step_clock``): a step's outputs are detokenised, streamed or sent to another process, once a
        step, whatever its tokens. A plain decode burst pays that once for its tokens, a speculative step once for
        its ~2-3: left out, it made speculation look cheaper than it is (on the demo LM at 4 concurrent n-gram
        sequences ~0.17 ms a step beside the ~1-2 ms timed). Where requests were added in between, their admission is
        not the step's: the step's own seconds count alone."""
        record, self._step_record = self._step_record, None
        if record is None or self.spec is None:
            return
        method, k, n, seconds, ended, added, burst = record
        if added == self._num_added:
            seconds += max(0.0, now - ended)
        self.spec.record_step(method, k, n, seconds / burst)

    def _run(self, batch: SchedulerOutput) -> tuple[list[_Work], torch.Tensor]:
        """Draft proposals, one forward over every scheduled sequence, then sampling or verification (or a decode
        burst)."""
        if self._burst:
            burst = self._run_burst(batch)
            if burst is not None:
                return burst
            self._burst = 0
        draft_probs = self._propose_drafts(batch)
        self._check_drafts(batch)
        works = self._plan_work(batch)
        plain = [w for w in works if w.samples and not w.spec]  # sampled in one batch, after the forward
        masks = self.sampler.prepare_masks([w.seq for w in plain])  # beside the forward on an accelerator
        try:
            logits = self.runner.execute([w.feed for w in works])  # logits: [sum of num_logits, V]
        finally:
            if masks is not None:
                masks.bits()  # the mask thread is done with the matchers, whatever happened
        self._sample(works, logits, draft_probs, plain, masks)
        return works, logits

    def _run_burst(self, batch: SchedulerOutput) -> tuple[list[_Work], torch.Tensor] | None:
        """Each sequence's next 1 + lookahead greedy tokens in one fused call (``ModelRunner.propose_greedy`` on the
        target: the argmax after each token, fed back at the next position); None where the fused step does not
        take the batch (the step then decodes one token a sequence, its lookahead slots freed)."""
        if any(item.num_new_tokens != 1 + item.num_lookahead for item in batch.scheduled):
            return None
        for item in batch.scheduled:
            item.seq.spec_token_ids = []
        works = self._plan_work(batch)
        tokens = self.runner.propose_greedy([w.feed for w in works], [1 + w.num_lookahead for w in works])
        if tokens is None:
            return None
        for w, new in zip(works, tokens, strict=True):
            w.new_token_ids, w.burst = new, True
        self.stats.decode_bursts += 1
        return works, self._no_logits

    def _propose_drafts(self, batch: SchedulerOutput) -> dict[int, torch.Tensor | None]:
        drafts: list[Sequence] = []
        for item in batch.scheduled:
            if item.num_lookahead and item.seq.spec_method == "draft":
                drafts.append(item.seq)
            elif not item.num_lookahead:
                item.seq.spec_token_ids = []
        if not drafts or self.drafter is None:
            return {}
        probs = self.drafter.propose(drafts)
        self.stats.draft_catch_up_tokens += self.drafter.catch_up_tokens
        if self.spec is not None:
            self.spec.record_catch_up(self.drafter.catch_up_tokens, self.drafter.catch_up_seconds)
        return probs

    @staticmethod
    def _check_drafts(batch: SchedulerOutput) -> None:
        """A constrained sequence's proposals are cut before the first its grammar refuses: the target could never
        pick it, so verifying it would cost a token slot for nothing (and the grammar cannot step past it)."""
        for item in batch.scheduled:
            seq = item.seq
            if item.num_lookahead and seq.constraint is not None:
                proposals = seq.spec_token_ids[: item.num_lookahead]
                seq.spec_token_ids = proposals[: seq.constraint.valid_prefix(proposals)]

    @staticmethod
    def _plan_work(batch: SchedulerOutput) -> list[_Work]:
        """Each scheduled sequence's feed: logits for its sampling rows (at its last token: 1 + proposals) and, for
        a request that wants prompt logprobs, for the prompt positions of the chunk it has not collected yet (a
        suffix of the chunk, ending where its sampling rows begin)."""
        works: list[_Work] = []
        row = 0
        for item in batch.scheduled:
            seq = item.seq
            spec = seq.spec_token_ids[: item.num_lookahead] if item.num_lookahead else []
            base = item.num_new_tokens - item.num_lookahead
            start = seq.num_computed_tokens
            end = start + base
            samples = end == seq.num_tokens
            num_sample = (1 + len(spec)) if samples else 0
            prompt_pos = num_prompt = 0
            if seq.needs_prompt_logits:
                # Position p's logits give prompt token p + 1's logprob; the last prompt position's are sampled.
                prompt_pos = max(start, len(seq.prompt_logprobs))
                num_prompt = max(0, min(end, seq.num_prompt_tokens - 1) - prompt_pos)
            num_logits = num_prompt + num_sample
            feed = Feed(seq.block_table, seq.token_ids[start:end] + spec, start, num_logits)
            works.append(
                _Work(
                    seq, start, base, spec, feed, row + num_prompt, samples, item.num_lookahead, prompt_pos, num_prompt
                )
            )
            row += num_logits
        return works

    def _sample(
        self,
        works: list[_Work],
        logits: torch.Tensor,
        draft_probs: dict[int, torch.Tensor | None],
        plain: list[_Work],
        masks: GrammarMasks | None,
    ) -> None:
        # Plain sampling for every sequence that reached its end without proposals, in one batch.
        if plain:
            row_ids = [w.row for w in plain]
            rows = logits
            if row_ids != list(range(len(logits))):  # (every row, in order, when all decode plainly: no copy)
                rows = logits.index_select(0, torch.tensor(row_ids, device=logits.device))
            # The grammar may mask a copy in place; never ``logits`` itself, which _append reads afterwards.
            tokens = self.sampler.sample(rows, [w.seq for w in plain], masks, inplace=rows is not logits)
            for w, tok in zip(plain, tokens, strict=True):
                w.new_token_ids = [tok]
        for w in works:
            if w.spec and w.samples:
                rows = logits[w.row : w.row + 1 + len(w.spec)]  # [K+1, V]
                rows = self.sampler.constrain_along(rows, w.seq, w.spec)  # each row under its grammar state
                w.new_token_ids = self.sampler.verify(rows, w.seq, w.spec, draft_probs.get(w.seq.seq_id))

    def _postprocess(self, works: list[_Work], logits: torch.Tensor) -> list[EngineCoreOutput]:
        """Advance each sequence past what it computed, append its new tokens, finish what ended; the progress of
        every request that gained tokens."""
        progress: dict[str, list[SequenceOutput]] = {}
        for w in works:
            self._advance(w)
            req = self._requests.get(w.seq.request_id)
            if req is None:
                continue
            if w.num_prompt_rows:
                self._collect_prompt_logprobs(w, logits)
            if not w.samples:
                continue
            progress.setdefault(req.request_id, []).append(self._append(w, logits))
        outputs = []
        for request_id, sequences in progress.items():
            req = self._requests[request_id]
            self._fork_siblings(req)
            first = req.seqs[0]
            outputs.append(EngineCoreOutput(request_id, sequences, first.num_cached_tokens, first.first_scheduled_time))
            if all(s.is_finished for s in req.seqs):
                del self._requests[request_id]
        return outputs

    def _advance(self, w: _Work) -> None:
        seq = w.seq
        if seq.is_prefilling or w.start < seq.num_prompt_tokens:
            self.stats.num_prompt_tokens_computed += min(w.num_base, max(0, seq.num_prompt_tokens - w.start))
        seq.num_computed_tokens = w.start + w.num_base
        if w.burst:  # every token's K/V is written but the last's, which the next step feeds
            seq.num_computed_tokens += len(w.new_token_ids) - 1
            self.block_manager.trim(seq)
        elif w.spec and w.samples:
            accepted = len(w.new_token_ids) - 1
            self._record_speculation(seq, len(w.spec), accepted)
            seq.num_computed_tokens += accepted
            seq.draft_num_computed_tokens = min(seq.draft_num_computed_tokens, seq.num_computed_tokens)
            seq.spec_token_ids = []
            self.block_manager.trim(seq)
        elif w.num_lookahead:  # its proposals were all cut (a grammar refused the first): free their slots
            seq.draft_num_computed_tokens = min(seq.draft_num_computed_tokens, seq.num_computed_tokens)
            seq.spec_token_ids = []
            self.block_manager.trim(seq)
        # (Accepted proposals and a burst's tokens are counted computed before ``_append`` adds them to the
        # sequence: their blocks are published there, or at the next step.)
        self.block_manager.register_full_blocks(seq)

    def _record_speculation(self, seq: Sequence, proposed: int, accepted: int) -> None:
        seq.num_spec_proposed += proposed
        seq.num_spec_accepted += accepted
        method = seq.spec_method
        if self.spec is not None and method:
            self.spec.record(method, proposed, accepted)
            self.stats.spec_proposed[method] = self.stats.spec_proposed.get(method, 0) + proposed
            self.stats.spec_accepted[method] = self.stats.spec_accepted.get(method, 0) + accepted

    @staticmethod
    def _collect_prompt_logprobs(w: _Work, logits: torch.Tensor) -> None:
        """The logprobs of the prompt tokens that this step's rows predict (chunked prefill: chunk by chunk)."""
        seq, n = w.seq, w.num_prompt_rows
        num_top = seq.params.prompt_logprobs or 0
        targets = seq.token_ids[w.prompt_pos + 1 : w.prompt_pos + 1 + n]
        seq.prompt_logprobs.extend(Sampler.logprobs(logits[w.row - n : w.row], targets, num_top, ranks=True))

    def _append(self, w: _Work, logits: torch.Tensor) -> SequenceOutput:
        """Append a sequence's new tokens up to the first that ends it (EOS, a stop token, a length limit); its
        first carries the prompt's logprobs when asked for. ``max_tokens == 0``: nothing is appended, the sequence
        ends ("length") after its prefill."""
        seq, tokens = w.seq, w.new_token_ids
        num_before = seq.num_output_tokens
        prompt_logprobs = None
        if num_before == 0 and seq.params.prompt_logprobs is not None and seq.sibling_index == 0:
            prompt_logprobs = list(seq.prompt_logprobs)
        if seq.max_tokens == 0:
            tokens.clear()
            self.scheduler.finish(seq, FinishReason.LENGTH)
            self.sampler.release(seq)
        if seq.params.logprobs is not None:
            seq.logprobs.extend(Sampler.logprobs(logits[w.row : w.row + len(tokens)], tokens, seq.params.logprobs))
        for i, tok in enumerate(tokens):
            seq.token_ids.append(tok)
            self.stats.num_generated_tokens += 1
            reason = self._finish_reason(seq, tok)
            if seq.constraint is not None:
                seq.constraint.accept(tok)
                if seq.constraint.done:  # the output is complete (whatever the length): nothing may follow
                    reason = FinishReason.STOP
                elif reason is None and i == len(tokens) - 1 and self._jumps_forward(seq):
                    forced = seq.constraint.forced_token()
                    if forced is not None:  # the loop takes it next; the next forward computes it with the rest
                        tokens.append(forced)
            if reason is not None:
                del seq.logprobs[seq.num_output_tokens :]
                del tokens[i + 1 :]
                self.block_manager.register_full_blocks(seq)  # its last blocks, before finishing frees them
                self.scheduler.finish(seq, reason)
                self.sampler.release(seq)
                break
        return SequenceOutput(
            seq.sibling_index,
            tokens,
            seq.logprobs[num_before:] if seq.params.logprobs is not None else None,
            seq.finish_reason.value if seq.finish_reason is not None else None,
            seq.num_spec_proposed,
            seq.num_spec_accepted,
            prompt_logprobs,
        )

    def _jumps_forward(self, seq: Sequence) -> bool:
        """Whether a token its grammar forces (the only one its mask allows) is appended without a forward of
        its own: the next step's forward computes it with the token before it. Not where the token needs the
        model's logits (logprobs) or would consume a seeded draw (a seeded sampled request draws the same random
        numbers as without jump-forward). Greedy output is the same: argmax over one allowed token is that token."""
        p = seq.params
        return self.config.grammar_jump_forward and p.logprobs is None and (p.seed is None or p.is_greedy)

    def _finish_reason(self, seq: Sequence, token: int) -> FinishReason | None:
        params = seq.params
        if (not params.ignore_eos and token in self.eos_token_ids) or token in params.stop_token_ids:
            return FinishReason.STOP
        if seq.num_output_tokens >= seq.max_tokens or seq.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def _fork_siblings(self, req: _Request) -> None:
        """n > 1: once the first sequence has its prompt computed, its siblings share the prompt's full blocks."""
        if not req.pending_siblings:
            return
        parent = req.seqs[0]
        if parent.num_output_tokens == 0 and not parent.is_finished:
            return
        num_full = parent.num_prompt_tokens // self.block_manager.block_size
        if parent.num_prompt_tokens % self.block_manager.block_size == 0:
            num_full -= 1  # leave the last prompt token to compute, for its logits
        for child in req.pending_siblings:
            if not parent.is_finished:
                self.block_manager.share(parent, child, num_full)
                child.num_computed_tokens = num_full * self.block_manager.block_size
                child.num_cached_tokens = child.num_computed_tokens
            self.scheduler.add_forked(child)
        req.pending_siblings = []

    # -- metrics ------------------------------------------------------------------------------------------------
    def metrics(self) -> dict[str, Any]:
        s = self.stats
        return {
            "num_steps": s.num_steps,
            "num_generated_tokens": s.num_generated_tokens,
            "num_preemptions": s.num_preemptions,
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "kv_cache_usage": round(self.block_manager.usage(), 4),
            "prefix_cache_hit_rate": round(self.block_manager.prefix_cache_hit_rate(), 4),
            "spec_acceptance": {m: round(s.spec_accepted.get(m, 0) / p, 4) for m, p in s.spec_proposed.items() if p},
            "spec_steps": dict(s.spec_steps),
            "draft_catch_up_tokens": s.draft_catch_up_tokens,
            "decode_bursts": s.decode_bursts,
        }
