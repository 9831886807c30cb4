"""The step loop: schedule, propose, run the model, verify or sample, append tokens, report progress."""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from cloud.engine.block_manager import BlockManager
from cloud.engine.config import EngineConfig
from cloud.engine.loader import resolve_dtype
from cloud.engine.model_config import ModelConfig
from cloud.engine.model_runner import Feed, ModelRunner
from cloud.engine.outputs import CompletionOutput, RequestOutput, Usage
from cloud.engine.sampler import Sampler
from cloud.engine.sampling_params import SamplingParams
from cloud.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from cloud.engine.sequence import FinishReason, Sequence
from cloud.engine.speculator import DraftProposer, SpecController, StepCost, ngram_proposal
from cloud.engine.tokenizer import ChatTokenizer, IncrementalDetokenizer
from shared.errors import ConfigurationError, ValidationError

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Request:
    request_id: str
    seqs: list[Sequence]
    detokenizers: list[IncrementalDetokenizer]
    pending_siblings: list[Sequence]
    arrival_time: float
    first_token_time: float | None = None
    emitted_tokens: list[int] = field(default_factory=list)
    streamed: bool = False  # an update with tokens has gone out
    held: RequestOutput | None = None  # what the stream interval holds back, merged into the next update


@dataclass(slots=True)
class EngineStats:
    num_steps: int = 0
    num_generated_tokens: int = 0
    num_prompt_tokens_computed: int = 0
    num_preemptions: int = 0
    spec_proposed: dict[str, int] = field(default_factory=dict)
    spec_accepted: dict[str, int] = field(default_factory=dict)


def encode_prompt(tokenizer: ChatTokenizer, vocab_size: int, prompt: str | list[int]) -> list[int]:
    """A prompt's token ids: a string encoded, a list of ids checked against the vocabulary."""
    if isinstance(prompt, str):
        return tokenizer.encode(prompt)
    if not prompt or not all(isinstance(t, int) and 0 <= t < vocab_size for t in prompt):
        raise ValidationError(f"prompt: token ids must be integers in [0, {vocab_size})", param="prompt")
    return list(prompt)


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

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.device = torch.device(config.device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigurationError("device 'cuda' requested but torch sees no CUDA device")
        model_config = ModelConfig.from_dir(config.model_dir)
        self.model_config = model_config
        self.tokenizer = ChatTokenizer(config.model_dir)
        self.max_model_len = min(config.max_model_len or model_config.max_position_embeddings, 1 << 20)
        dtype = resolve_dtype(model_config, self.device, config.dtype)
        self.dtype = dtype
        block_bytes = ModelRunner.kv_bytes_per_block(model_config, config.block_size, dtype)
        draft_config = ModelConfig.from_dir(config.draft_model_dir) if config.draft_model_dir else None
        if draft_config is not None:
            if draft_config.vocab_size != model_config.vocab_size:
                raise ConfigurationError(
                    f"draft vocab_size {draft_config.vocab_size} differs from the model's {model_config.vocab_size}"
                )
            block_bytes += ModelRunner.kv_bytes_per_block(draft_config, config.block_size, dtype)
        budget = config.kv_cache_bytes or int(available_memory_bytes(self.device) * config.kv_cache_fraction)
        num_blocks = budget // block_bytes
        min_blocks = -(-self.max_model_len // config.block_size) + 1
        if num_blocks < min_blocks:
            raise ConfigurationError(
                f"KV budget of {budget} bytes holds {num_blocks} blocks; one max-length sequence needs {min_blocks}"
            )
        self.num_blocks = int(num_blocks)
        self.runner = ModelRunner(
            config.model_dir, self.device, dtype, config.block_size, self.num_blocks, self.max_model_len
        )
        self.draft_runner = (
            ModelRunner(
                config.draft_model_dir, self.device, dtype, config.block_size, self.num_blocks, self.max_model_len
            )
            if config.draft_model_dir is not None
            else None
        )
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
        self.drafter = DraftProposer(self.draft_runner, self.sampler) if self.draft_runner is not None else None
        self.spec: SpecController | None = None
        if config.speculation != "off" or self.draft_runner is not None:
            target_cost = StepCost.measure(self.runner, config.max_num_batched_tokens)
            draft_cost = StepCost.measure(self.draft_runner, config.max_num_seqs) if self.draft_runner else None
            self.spec = SpecController(
                config.num_speculative_tokens, target_cost, draft_cost, adaptive=config.adaptive_speculation
            )
        self._requests: dict[str, _Request] = {}
        self._seq_ids = itertools.count()
        self.stats = EngineStats()
        logger.info(
            "engine ready: %s (%s, %s), %d KV blocks of %d tokens, speculation %s",
            config.model_dir.name,
            self.device,
            str(dtype).removeprefix("torch."),
            self.num_blocks,
            config.block_size,
            config.speculation,
        )

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
        if request_id in self._requests:
            raise ValidationError(f"request id {request_id!r} is already in flight", param="request_id")
        prompt_ids = self.encode_prompt(prompt)
        if not prompt_ids:
            raise ValidationError("prompt: must not be empty", param="prompt")
        limit = self.max_model_len
        if len(prompt_ids) >= limit:
            raise ValidationError(
                f"This model's maximum context length is {limit} tokens. However, your prompt is "
                f"{len(prompt_ids)} tokens, leaving no room for a completion.",
                param="prompt",
                code="context_length_exceeded",
            )
        max_tokens = params.max_tokens if params.max_tokens is not None else limit - len(prompt_ids)
        if len(prompt_ids) + max_tokens > limit:
            raise ValidationError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{len(prompt_ids) + max_tokens} tokens ({len(prompt_ids)} in the prompt, {max_tokens} in the "
                "completion). Please reduce the prompt or max_tokens.",
                param="max_tokens",
                code="context_length_exceeded",
            )
        now = arrival_time if arrival_time is not None else time.monotonic()
        seqs = [
            Sequence(
                seq_id=next(self._seq_ids),
                request_id=request_id,
                token_ids=list(prompt_ids),
                num_prompt_tokens=len(prompt_ids),
                params=params,
                arrival_time=now,
                priority=priority,
                cache_salt=cache_salt,
                max_tokens=max_tokens,
                sibling_index=i,
            )
            for i in range(params.n)
        ]
        self.scheduler.add(seqs[:1])
        self._requests[request_id] = _Request(
            request_id,
            seqs,
            [IncrementalDetokenizer(self.tokenizer, params.stop) for _ in seqs],
            seqs[1:],
            now,
        )

    def abort_request(self, request_id: str) -> None:
        """Stop a request and free its blocks at once (unknown or finished ids are ignored)."""
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

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._requests)

    # -- the step -----------------------------------------------------------------------------------------------
    def _plan_speculation(self) -> None:
        if self.spec is None:
            return
        by_method: dict[str, list[Sequence]] = {"draft": [], "ngram": []}
        other_tokens = 0
        for seq in self.scheduler.running:
            seq.num_lookahead = 0
            method = seq.params.speculation or self.config.speculation or "off"
            if seq.num_uncomputed_tokens != 1:
                other_tokens += seq.num_uncomputed_tokens
                continue
            # Penalties depend on every accepted token, and a seeded sampled request must draw the same random
            # numbers whatever the load (speculation would consume them differently): both decode plainly.
            seeded_sampling = seq.params.seed is not None and not seq.params.is_greedy
            if (
                method == "off"
                or seq.params.has_penalties
                or seeded_sampling
                or (method == "draft" and self.drafter is None)
            ):
                other_tokens += 1
                continue
            seq.spec_method = method
            by_method[method].append(seq)
        for method, seqs in by_method.items():
            if not seqs:
                continue
            k = self.spec.choose_k(method, len(seqs), other_tokens)
            for seq in seqs:
                room = min(seq.max_tokens - seq.num_output_tokens, self.max_model_len - seq.num_tokens) - 1
                look = max(0, min(k, room))
                if method == "ngram" and look:
                    seq.spec_token_ids = ngram_proposal(seq.token_ids, look)
                    look = len(seq.spec_token_ids)
                seq.num_lookahead = look

    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns an update for every request that progressed or finished."""
        self._plan_speculation()
        out = self.scheduler.schedule()
        self.stats.num_preemptions = self.scheduler.num_preemptions
        touched: dict[str, _Request] = {}
        if out.scheduled:
            self._run(out, touched)
        self.stats.num_steps += 1
        outputs: list[RequestOutput] = []
        interval = self.config.stream_interval
        now = time.monotonic()  # the step hands its updates back now: a finished request's engine latency ends here
        for req in touched.values():
            output = self._output(req)  # every step: stop strings end a sequence as soon as they appear
            if req.held is not None:
                output, req.held = _merge(req.held, output), None
            if output.finished:
                output.engine_s = now - req.arrival_time
            elif req.streamed and max(len(c.delta_token_ids) for c in output.outputs) < interval:
                req.held = output  # neither the first tokens, nor the last, nor stream_interval of them yet
                continue
            req.streamed = True
            outputs.append(output)
        return outputs

    def _run(self, out: SchedulerOutput, touched: dict[str, _Request]) -> None:
        drafts: list[Sequence] = []
        for item in out.scheduled:
            seq = item.seq
            if item.num_lookahead and seq.spec_method == "draft":
                drafts.append(seq)
            elif not item.num_lookahead:
                seq.spec_token_ids = []
        draft_probs = self.drafter.propose(drafts) if drafts and self.drafter is not None else {}
        feeds: list[Feed] = []
        plans: list[tuple[Sequence, int, int, list[int]]] = []  # seq, start, base tokens, proposals
        for item in out.scheduled:
            seq = item.seq
            spec = seq.spec_token_ids[: item.num_lookahead] if item.num_lookahead else []
            base = item.num_new_tokens - item.num_lookahead
            start = seq.num_computed_tokens
            reaches_end = start + base == seq.num_tokens
            feeds.append(
                Feed(
                    seq.block_table,
                    seq.token_ids[start : start + base] + spec,
                    start,
                    (1 + len(spec)) if reaches_end else 0,
                )
            )
            plans.append((seq, start, base, spec))
        logits = self.runner.execute(feeds)
        # Plain sampling for every sequence that reached its end without proposals, in one batch.
        row = 0
        plain_rows: list[int] = []
        plain_seqs: list[Sequence] = []
        spec_rows: dict[int, int] = {}
        for feed, (seq, _start, _base, spec) in zip(feeds, plans, strict=True):
            if feed.num_logits and not spec:
                plain_rows.append(row)
                plain_seqs.append(seq)
            elif spec:
                spec_rows[seq.seq_id] = row
            row += feed.num_logits
        sampled: dict[int, list[int]] = {}
        plain_row_of = {seq.seq_id: r for seq, r in zip(plain_seqs, plain_rows, strict=True)}
        if plain_seqs:
            plain_logits = logits[plain_rows]
            for seq, tok in zip(plain_seqs, self.sampler.sample(plain_logits, plain_seqs), strict=True):
                sampled[seq.seq_id] = [tok]
        now = time.monotonic()
        for feed, (seq, start, base, spec) in zip(feeds, plans, strict=True):
            if seq.is_prefilling or start < seq.num_prompt_tokens:
                self.stats.num_prompt_tokens_computed += min(base, max(0, seq.num_prompt_tokens - start))
            if not feed.num_logits:
                seq.num_computed_tokens = start + base
                self.block_manager.register_full_blocks(seq)
                continue
            first_row = spec_rows.get(seq.seq_id, -1)
            if spec:
                rows = logits[first_row : first_row + 1 + len(spec)]
                new = self.sampler.verify(rows, seq, spec, draft_probs.get(seq.seq_id))
                self._record_speculation(seq, len(spec), len(new) - 1)
                seq.num_computed_tokens = start + base + len(new) - 1
                seq.draft_num_computed_tokens = min(seq.draft_num_computed_tokens, seq.num_computed_tokens)
                seq.spec_token_ids = []
                self.block_manager.trim(seq)
            else:
                new = sampled[seq.seq_id]
                seq.num_computed_tokens = start + base
                first_row = plain_row_of[seq.seq_id]
            self.block_manager.register_full_blocks(seq)
            if seq.params.logprobs is not None:
                seq.logprobs.extend(
                    Sampler.logprobs(logits[first_row : first_row + len(new)], new, seq.params.logprobs)
                )
            req = self._requests.get(seq.request_id)
            if req is None:
                continue
            touched[req.request_id] = req
            if req.first_token_time is None:
                req.first_token_time = now
            self._append(req, seq, new)
        for req in list(touched.values()):
            self._fork_siblings(req)

    def _record_speculation(self, seq: Sequence, proposed: int, accepted: int) -> None:
        seq.num_spec_proposed += proposed
        seq.num_spec_accepted += accepted
        method = seq.spec_method
        if self.spec is not None and method:
            self.spec.record(method, proposed, accepted)
            self.stats.spec_proposed[method] = self.stats.spec_proposed.get(method, 0) + proposed
            self.stats.spec_accepted[method] = self.stats.spec_accepted.get(method, 0) + accepted

    def _append(self, req: _Request, seq: Sequence, tokens: list[int]) -> None:
        params = seq.params
        for i, tok in enumerate(tokens):
            seq.token_ids.append(tok)
            self.stats.num_generated_tokens += 1
            reason: FinishReason | None = None
            if (not params.ignore_eos and tok in self.eos_token_ids) or tok in params.stop_token_ids:
                reason = FinishReason.STOP
            elif seq.num_output_tokens >= seq.max_tokens or seq.num_tokens >= self.max_model_len:
                reason = FinishReason.LENGTH
            if reason is not None:
                if len(seq.logprobs) > seq.num_output_tokens:
                    del seq.logprobs[seq.num_output_tokens :]
                del tokens[i + 1 :]
                self.scheduler.finish(seq, reason)
                self.sampler.release(seq)
                return

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

    # -- outputs ------------------------------------------------------------------------------------------------
    def _output(self, req: _Request) -> RequestOutput:
        outputs = []
        finished = True
        for i, (seq, detok) in enumerate(zip(req.seqs, req.detokenizers, strict=True)):
            is_final = seq.is_finished
            out_ids = seq.output_token_ids
            delta_text, stopped = detok.update(out_ids, is_final)
            if stopped and not seq.is_finished:
                self.scheduler.finish(seq, FinishReason.STOP)
                self.sampler.release(seq)
            finished = finished and seq.is_finished
            emitted = detok.num_emitted_tokens
            detok.num_emitted_tokens = len(out_ids)
            outputs.append(
                CompletionOutput(
                    index=i,
                    text=detok.text,
                    token_ids=list(out_ids),
                    logprobs=list(seq.logprobs) if seq.params.logprobs is not None else None,
                    finish_reason=seq.finish_reason.value if seq.finish_reason else None,
                    delta_text=delta_text,
                    delta_token_ids=out_ids[emitted:],
                    delta_logprobs=seq.logprobs[emitted:] if seq.params.logprobs is not None else [],
                    num_spec_proposed=seq.num_spec_proposed,
                    num_spec_accepted=seq.num_spec_accepted,
                )
            )
        first = req.seqs[0]
        usage = Usage(
            prompt_tokens=first.num_prompt_tokens,
            completion_tokens=sum(s.num_output_tokens for s in req.seqs),
            cached_tokens=first.num_cached_tokens,
        )
        if finished:
            del self._requests[req.request_id]
        return RequestOutput(
            request_id=req.request_id,
            prompt_token_ids=first.prompt_token_ids,
            outputs=outputs,
            finished=finished,
            usage=usage,
            ttft_s=(req.first_token_time - req.arrival_time) if req.first_token_time else None,
        )

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
        }


def _merge(held: RequestOutput, later: RequestOutput) -> RequestOutput:
    """``later`` carrying the deltas of ``held`` (an update the stream interval held back) before its own."""
    for before, choice in zip(held.outputs, later.outputs, strict=True):
        choice.delta_text = before.delta_text + choice.delta_text
        choice.delta_token_ids = before.delta_token_ids + choice.delta_token_ids
        choice.delta_logprobs = before.delta_logprobs + choice.delta_logprobs
    return later
