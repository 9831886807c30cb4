"""``tierline bench structured``: what constrained decoding (``response_format``) costs.

Decode throughput of the cloud engine with and without a JSON schema's grammar, one request at a time (batch 1)
and 32 requests at once; the same at batch 1 on the edge runtime (ONNX Runtime: the INT8 export, and the fp32 one,
where jump-forward runs forced tokens together); and the grammar
engine's own costs: building a model's grammar tokenizer, compiling a schema, computing one token's mask (p50 and
p99, over the masks of real constrained generations).

Every run decodes greedily to ``max_tokens``: the schema (an array of bounded strings that needs at least
``max_tokens`` items, so no output can close it in time) keeps constrained outputs going, and unconstrained ones
ignore EOS, so both sides generate the same number of tokens and tokens/s compare the same work. (Without the
lower bound the tiny zoo's model closed most objects after 47 tokens: the constrained side then finished its
batch with fewer rows and was charged for that, not for its masks.) Each batch size alternates the two sides
``rounds`` times and reports medians, in tokens per wall-clock second and per CPU-second (a shared host's load
moves the second far less). The constrained side runs twice a round: as served (jump-forward on: a token the
grammar forces is appended without a forward of its own) and with jump-forward off (one forward per token, as
the unconstrained side: what the masks alone cost). ``steps`` counts engine steps (forwards) per run.

``step_costs``: the parts of a constrained step, each timed around its own call during a constrained run at 8
concurrent (jump-forward off, so every mask is computed in the batch fill; the timers add their own overhead):
computing one mask, applying a batch's masks to its logits, advancing a matcher past a token, the jump-forward
check, and detokenising a token in the output processor (constrained against unconstrained output).
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench.engine_bench import KV_BYTES, _lm
from cloud.engine import output_processor as output_processor_module
from cloud.engine import sampler as sampler_module
from cloud.engine.config import EngineConfig
from cloud.engine.llm_engine import LLMEngine
from cloud.engine.sampling_params import SamplingParams
from edge_agent.generation import LocalLM, LocalRequest
from shared.openai_schema import ResponseFormat
from shared.structured import Constraint, GrammarTokenizer, grammar_of

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 24},
        "count": {"type": "integer", "minimum": 0, "maximum": 1000},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 400},
    },
    "required": ["title", "count", "tags"],
    "additionalProperties": False,
}
ROUNDS = 3  # unconstrained/constrained pairs per batch size
PROMPTS = ["def main():", "import os\n", "class Config:", "# parse the", "for item in", "return {", "x = [", "if not"]


def _grammar(max_tokens: int) -> str:
    schema = copy.deepcopy(SCHEMA)
    schema["properties"]["tags"]["minItems"] = max_tokens  # each item takes a token at least: never closed in time
    schema["properties"]["tags"]["maxItems"] = max(max_tokens, 400)
    fmt = ResponseFormat.model_validate({"type": "json_schema", "json_schema": {"name": "bench", "schema": schema}})
    grammar = grammar_of(fmt)
    assert grammar is not None
    return grammar


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(len(ordered) * q / 100))], 2) if ordered else 0.0


def _engine_rate(
    engine: LLMEngine, concurrency: int, num_requests: int, max_tokens: int, grammar: str | None
) -> dict[str, Any]:
    """Tokens/s for ``num_requests`` requests, ``concurrency`` in the engine at a time."""
    prompts = [engine.encode_prompt(PROMPTS[i % len(PROMPTS)]) for i in range(num_requests)]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=grammar is None, grammar=grammar)
    started, cpu_started = time.perf_counter(), time.process_time()
    tokens = steps = 0
    for first in range(0, num_requests, concurrency):
        batch = list(range(first, min(num_requests, first + concurrency)))
        for i in batch:
            engine.add_request(f"{'s' if grammar else 'p'}{i}", prompts[i], params)
        while engine.has_unfinished_requests():
            steps += 1
            for out in engine.step():
                if out.finished:
                    tokens += len(out.token_ids)
    seconds, cpu_seconds = time.perf_counter() - started, time.process_time() - cpu_started
    return {
        "tokens": tokens,
        "steps": steps,
        "seconds": round(seconds, 3),
        "tokens_per_s": round(tokens / seconds, 1),
        "cpu_seconds": round(cpu_seconds, 3),  # every thread of this process: the mask thread's work counts
        "tokens_per_cpu_s": round(tokens / cpu_seconds, 1),
    }


def _compare(engine: LLMEngine, concurrency: int, count: int, max_tokens: int, grammar: str, rounds: int) -> Any:
    """Unconstrained, constrained and constrained without jump-forward runs alternated ``rounds`` times (a shared
    host's load drifts between runs): the median of each side and the median of the per-round ratios, wall clock
    and CPU time."""
    triples = []
    for _ in range(rounds):
        plain = _engine_rate(engine, concurrency, count, max_tokens, None)
        constrained = _engine_rate(engine, concurrency, count, max_tokens, grammar)
        engine.config.grammar_jump_forward = False
        try:
            masks_only = _engine_rate(engine, concurrency, count, max_tokens, grammar)
        finally:
            engine.config.grammar_jump_forward = True
        triples.append((plain, constrained, masks_only))

    def median(side: int, key: str) -> float:
        return round(statistics.median(t[side][key] for t in triples), 1)

    def ratio(side: int, key: str) -> float:
        return round(statistics.median(t[side][key] / t[0][key] for t in triples), 3)

    return {
        "rounds": rounds,
        "tokens_per_run": triples[0][0]["tokens"],
        "unconstrained_tokens_per_s": median(0, "tokens_per_s"),
        "constrained_tokens_per_s": median(1, "tokens_per_s"),
        "ratio": ratio(1, "tokens_per_s"),
        "unconstrained_tokens_per_cpu_s": median(0, "tokens_per_cpu_s"),
        "constrained_tokens_per_cpu_s": median(1, "tokens_per_cpu_s"),
        "cpu_ratio": ratio(1, "tokens_per_cpu_s"),
        "constrained_tokens_per_run": [t[1]["tokens"] for t in triples],
        "steps_per_run": {"unconstrained": triples[0][0]["steps"], "constrained": triples[0][1]["steps"]},
        "without_jump_forward": {
            "constrained_tokens_per_s": median(2, "tokens_per_s"),
            "ratio": ratio(2, "tokens_per_s"),
            "constrained_tokens_per_cpu_s": median(2, "tokens_per_cpu_s"),
            "cpu_ratio": ratio(2, "tokens_per_cpu_s"),
            "steps_per_run": triples[0][2]["steps"],
        },
    }


def _edge_rate(lm: LocalLM, num_requests: int, max_tokens: int, grammar: str | None) -> dict[str, Any]:
    started, cpu_started = time.perf_counter(), time.process_time()
    tokens = 0
    for i in range(num_requests):
        req = LocalRequest(
            prompt_ids=lm.tokenizer.encode(PROMPTS[i % len(PROMPTS)]),
            max_tokens=max_tokens,
            temperature=0.0,
            ignore_eos=grammar is None,
            grammar=grammar,
        )
        tokens += sum(1 for _ in lm.generate(req))
    seconds, cpu_seconds = time.perf_counter() - started, time.process_time() - cpu_started
    return {
        "tokens": tokens,
        "seconds": round(seconds, 3),
        "tokens_per_s": round(tokens / seconds, 1),
        "tokens_per_cpu_s": round(tokens / cpu_seconds, 1),
    }


def _edge_compare(lm: LocalLM, num_requests: int, max_tokens: int, grammar: str, rounds: int) -> dict[str, Any]:
    """The edge runtime at batch 1: unconstrained, constrained and constrained without jump-forward, alternated
    ``rounds`` times; medians and the median of the per-round ratios."""
    triples = []
    for _ in range(rounds):
        plain = _edge_rate(lm, num_requests, max_tokens, None)
        constrained = _edge_rate(lm, num_requests, max_tokens, grammar)
        lm.jump_forward = False
        try:
            masks_only = _edge_rate(lm, num_requests, max_tokens, grammar)
        finally:
            lm.jump_forward = True
        triples.append((plain, constrained, masks_only))

    def ratio(side: int, key: str) -> float:
        return round(statistics.median(t[side][key] / t[0][key] for t in triples), 3)

    def median(side: int, key: str) -> float:
        return round(statistics.median(t[side][key] for t in triples), 1)

    return {
        "rounds": rounds,
        "tokens_per_run": triples[0][0]["tokens"],
        "unconstrained_tokens_per_s": median(0, "tokens_per_s"),
        "constrained_tokens_per_s": median(1, "tokens_per_s"),
        "ratio": ratio(1, "tokens_per_s"),
        "cpu_ratio": ratio(1, "tokens_per_cpu_s"),
        "constrained_tokens_per_run": [t[1]["tokens"] for t in triples],
        "without_jump_forward": {
            "constrained_tokens_per_s": median(2, "tokens_per_s"),
            "ratio": ratio(2, "tokens_per_s"),
            "cpu_ratio": ratio(2, "tokens_per_cpu_s"),
        },
    }


class _Timer:
    """Wraps ``owner.name`` so each call's duration (µs) is recorded; ``restore()`` puts the original back."""

    def __init__(self, owner: Any, name: str) -> None:
        self.owner, self.name, self.original = owner, name, getattr(owner, name)
        self.us: list[float] = []
        original, us = self.original, self.us

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                us.append((time.perf_counter() - t0) * 1e6)

        setattr(owner, name, timed)

    def restore(self) -> None:
        setattr(self.owner, self.name, self.original)

    def summary(self) -> dict[str, float]:
        return {"p50_us": _pct(self.us, 50), "p99_us": _pct(self.us, 99), "calls": len(self.us)}


def _step_costs(engine: LLMEngine, grammar: str, max_tokens: int) -> dict[str, Any]:
    """The parts of a constrained step, timed one by one (see the module's note)."""
    mask_us: list[float] = []
    original = sampler_module.fill_bitmasks

    def timed(constraints: Sequence[Constraint], bits: np.ndarray) -> None:
        for i, constraint in enumerate(constraints):  # one token's mask at a time (the engine fills a batch's)
            t0 = time.perf_counter()
            original([constraint], bits[i : i + 1])
            mask_us.append((time.perf_counter() - t0) * 1e6)

    detok: dict[str, _Timer] = {}
    costs: dict[str, Any] = {}
    for side in ("unconstrained", "constrained"):
        detok[side] = _Timer(output_processor_module.IncrementalDetokenizer, "update")
        try:
            _engine_rate(engine, 8, 8, max_tokens, None if side == "unconstrained" else grammar)
        finally:
            detok[side].restore()
    timers: dict[str, _Timer] = {}
    sampler_module.fill_bitmasks = timed
    engine.config.grammar_jump_forward = False
    try:
        timers["apply_masks_per_step"] = _Timer(sampler_module.Sampler, "constrain")
        timers["consume_token"] = _Timer(Constraint, "accept")
        _engine_rate(engine, 8, 8, max_tokens, grammar)
    finally:
        sampler_module.fill_bitmasks = original
        engine.config.grammar_jump_forward = True
        for timer in timers.values():
            timer.restore()
    forced = _Timer(Constraint, "forced_token")  # jump-forward's check: computes the next mask, kept for the step
    try:
        _engine_rate(engine, 8, 8, max_tokens, grammar)
    finally:
        forced.restore()
    costs["mask_us_p50"] = _pct(mask_us, 50)
    costs["mask_us_p99"] = _pct(mask_us, 99)
    costs["masks_timed"] = len(mask_us)
    costs["step_costs"] = {
        **{name: t.summary() for name, t in timers.items()},
        "jump_forward_check": forced.summary(),
        "detokenize_update": {side: t.summary() for side, t in detok.items()},
    }
    return costs


def _compile_costs(grammar_tokenizer: GrammarTokenizer, grammar: str) -> dict[str, Any]:
    compile_s = []
    for _ in range(5):
        grammar_tokenizer._compiled.clear()  # a first request's cost: later ones copy the compiled grammar
        t0 = time.perf_counter()
        grammar_tokenizer.check(grammar)
        Constraint(grammar_tokenizer, grammar)
        compile_s.append(time.perf_counter() - t0)
    return {"grammar_compile_ms_p50": round(statistics.median(compile_s) * 1e3, 3)}


def bench_structured(
    zoo_root: Path, num_requests: int = 32, max_tokens: int = 64, rounds: int = ROUNDS
) -> dict[str, Any]:
    grammar = _grammar(max_tokens)
    engine = LLMEngine(EngineConfig(_lm(zoo_root, "lm-cloud"), kv_cache_bytes=KV_BYTES, max_num_seqs=64))
    t0 = time.perf_counter()
    grammar_tokenizer = GrammarTokenizer(engine.tokenizer, engine.model_config.vocab_size, engine.eos_token_ids)
    tokenizer_ms = (time.perf_counter() - t0) * 1e3
    _engine_rate(engine, 4, 4, 8, None)  # warm-up (allocations, first forward)
    _engine_rate(engine, 4, 4, 8, grammar)
    cloud: dict[str, Any] = {}
    for concurrency, count in ((1, max(4, num_requests // 4)), (32, num_requests)):
        cloud[f"batch_{concurrency}"] = _compare(engine, concurrency, count, max_tokens, grammar, rounds)
    costs = {**_compile_costs(grammar_tokenizer, grammar), **_step_costs(engine, grammar, max_tokens)}
    edge: dict[str, Any] = {}
    for name in ("lm-edge-onnx-int8", "lm-edge-onnx"):
        edge_lm = LocalLM(_lm(zoo_root, name))
        _edge_rate(edge_lm, 1, 8, grammar)
        edge[name] = _edge_compare(edge_lm, 8, max_tokens, grammar, rounds)
    return {
        "bench": "structured-output",
        "grammar_engine": "llguidance",
        "max_tokens": max_tokens,
        "grammar_tokenizer_build_ms": round(tokenizer_ms, 2),
        **costs,
        "cloud": cloud,
        "edge_onnx_int8_batch_1": edge["lm-edge-onnx-int8"],  # one runtime call a token (see LocalLM.jump_forward)
        "edge_onnx_fp32_batch_1": edge["lm-edge-onnx"],
    }
