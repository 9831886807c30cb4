"""Local generation on a device runtime (ONNX Runtime, LiteRT or llama.cpp): the cloud engine's sampling semantics in
numpy, one sequence at a time per model (the runtime holds one KV cache; a lock serialises requests)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import numpy as np

from edge_agent.runtime import CausalLMRuntime, load_runtime
from shared.chat_tokenizer import ChatTokenizer, IncrementalDetokenizer
from shared.errors import ApplicationError, ValidationError
from shared.escalation import StepSignal, step_signal
from shared.openai_responses import Logprob
from shared.sampling import choose, logprob_of
from shared.structured import GrammarTokenizer


class ModelFaultError(RuntimeError):
    """The runtime failed on a request that passed validation: a fault of the model version (the health watch
    counts these, and only these, towards rolling a freshly installed version back)."""


def run_model(model: str, call: Callable[[], np.ndarray]) -> np.ndarray:
    """``call()`` (a runtime step), its unexpected failure raised as the model's fault."""
    try:
        return call()
    except ApplicationError:
        raise
    except Exception as exc:
        raise ModelFaultError(f"{model}: {type(exc).__name__}: {exc}") from exc


@dataclass(slots=True)
class LocalRequest:
    prompt_ids: list[int]
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    grammar: str | None = None  # the output must match it (response_format; shared.structured)
    keep_logits: bool = False  # hand each sampled step's logits on (the LM hidden-state probe's running mean)


@dataclass(slots=True)
class LocalStep:
    """One generated token: the text it completes (UTF-8 safe, never part of a stop string) and why it ended."""

    token_id: int
    delta_text: str
    logprob: Logprob | None
    finish_reason: str | None
    signal: StepSignal | None = None  # confidence evidence for the escalation policy
    logits: np.ndarray | None = None  # the step's raw logits (``keep_logits``); the consumer folds and drops them


class LocalLM:
    def __init__(self, model_dir: Path, num_threads: int = 1, variant: str | None = None) -> None:
        self.runtime: CausalLMRuntime = load_runtime(model_dir, num_threads, variant)
        self.tokenizer = ChatTokenizer(model_dir)
        self.eos_token_ids = set(self.tokenizer.eos_token_ids)  # generation_config.json's, else the tokenizer's
        self.max_context = self.runtime.max_context
        self.vocab_size = self.runtime.vocab_size or self.tokenizer.vocab_size
        self._lock = threading.Lock()
        self._grammar_tokenizer: GrammarTokenizer | None = None
        # A token the grammar forces (the only one its mask allows) is taken without sampling and run through the
        # model with the tokens before it in one call (as the cloud engine's ``grammar_jump_forward``); on a runtime
        # whose several-token calls are not token-exact (``exact_chunks``: dynamic INT8), one call a token still, so
        # greedy output stays the token-by-token one (only the mask, the draw and the signal are skipped).
        self.jump_forward = True

    def grammar_tokenizer(self) -> GrammarTokenizer:
        """This model's tokenizer for the grammar engine (400 if llguidance is not installed here)."""
        if self._grammar_tokenizer is None:
            self._grammar_tokenizer = GrammarTokenizer(self.tokenizer, self.vocab_size, self.eos_token_ids)
        return self._grammar_tokenizer

    def check_grammar(self, grammar: str) -> None:
        """Refuse (400, naming the problem) a grammar the engine cannot compile for this model: before any
        response starts, so a stream is refused with a status, not cut."""
        self.grammar_tokenizer().check(grammar)

    def check(self, req: LocalRequest) -> int:
        """Validate lengths up front (OpenAI semantics); returns the effective max_tokens."""
        n = len(req.prompt_ids)
        if n == 0:
            raise ValidationError("prompt: must not be empty", param="prompt")
        bad = next((t for t in req.prompt_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValidationError(
                f"prompt: token id {bad} is outside this model's vocabulary (0 to {self.vocab_size - 1})",
                param="prompt",
                code="invalid_token_id",
            )
        if n >= self.max_context:
            raise ValidationError(
                f"This model's maximum context length is {self.max_context} tokens. However, your prompt is "
                f"{n} tokens, leaving no room for a completion.",
                param="prompt",
                code="context_length_exceeded",
            )
        max_tokens = req.max_tokens if req.max_tokens is not None else self.max_context - n
        if n + max_tokens > self.max_context:
            raise ValidationError(
                f"This model's maximum context length is {self.max_context} tokens. However, you requested "
                f"{n + max_tokens} tokens ({n} in the prompt, {max_tokens} in the completion).",
                param="max_tokens",
                code="context_length_exceeded",
            )
        return max_tokens

    def generate(self, req: LocalRequest) -> Iterator[LocalStep]:
        """Blocking: run it in a worker thread. Holds the model until the iterator is exhausted or closed."""
        max_tokens = self.check(req)
        constraint = self.grammar_tokenizer().constraint(req.grammar) if req.grammar is not None else None
        # numpy takes a non-negative seed: a negative one (OpenAI's range is signed 64-bit) as its two's complement.
        rng = np.random.default_rng(req.seed % (1 << 64) if req.seed is not None else None)
        detok = IncrementalDetokenizer(self.tokenizer, req.stop)
        out: list[int] = []
        model = self.runtime.model_dir.name
        # Jump-forward: not where a token needs the model's logits (logprobs) or would have consumed a seeded draw.
        jump = constraint is not None and self.jump_forward and req.logprobs is None
        jump = jump and (req.seed is None or req.temperature == 0.0)
        unfed: list[int] = []  # tokens taken since the model last ran (jump-forward), fed with the next one
        forced: int | None = None
        with self._lock:
            self.runtime.reset()
            logits = run_model(model, partial(self.runtime.prefill, req.prompt_ids))
            while True:
                lp = signal = kept = None
                if forced is not None:  # the grammar allows this token only: no logits, no evidence of confidence
                    token = forced
                else:
                    allowed = logits
                    if constraint is not None:  # forbidden tokens cannot be drawn; logprobs stay the model's
                        allowed = np.where(constraint.mask(logits.shape[-1]), logits, -np.inf)
                    token = choose(allowed, rng, req.temperature, req.top_p, req.top_k, req.min_p)
                    lp = logprob_of(logits, token, req.logprobs) if req.logprobs is not None else None
                    signal = step_signal(logits, token)
                    kept = np.array(logits, dtype=np.float64) if req.keep_logits else None
                out.append(token)
                reason = None
                if constraint is not None:
                    constraint.accept(token)
                if not req.ignore_eos and token in self.eos_token_ids:
                    reason = "stop"
                elif constraint is not None and constraint.done:
                    reason = "stop"  # the output is complete: nothing may follow
                elif len(out) >= max_tokens:
                    reason = "length"
                delta, stopped = detok.update(out, is_final=reason is not None)
                if stopped:
                    reason = "stop"
                yield LocalStep(token, delta, lp, reason, signal, kept)
                if reason is not None:
                    return
                forced = constraint.forced_token() if jump and constraint is not None else None
                if forced is not None and self.runtime.exact_chunks:
                    unfed.append(token)  # run with the tokens after it, in one call
                    continue
                if unfed:
                    unfed.append(token)
                    logits = run_model(model, partial(self.runtime.prefill, unfed))
                    unfed = []
                else:
                    logits = run_model(model, partial(self.runtime.decode, token))
