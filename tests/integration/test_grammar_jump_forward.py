"""Jump-forward under a grammar: a token the grammar forces (the only one its mask allows) is appended without a
forward of its own and computed by the next forward together with the token before it. The output must be the
token-by-token output, token for token (greedy, on the cloud engine with and without speculation, in mixed
batches with n > 1, and on the edge runtimes), in fewer model calls; requests that need every token's logits
(logprobs) decode token by token."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cloud.engine import LLM, SamplingParams
from edge_agent.generation import LocalLM, LocalRequest
from shared.openai_schema import ChatCompletionRequest, ResponseFormat
from shared.structured import Constraint, GrammarTokenizer, fill_bitmasks, grammar_of
from shared.tools import grammar as tool_grammar
from shared.zoo.registry import ZooLayout

KV = 16 << 20
PET = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "kind": {"enum": ["cat", "dog", "hamster"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 30},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
    },
    "required": ["name", "kind", "age", "tags"],
    "additionalProperties": False,
}
PROMPTS = ['pets: {"name":"Rex","kind":"dog","age":3,"tags":["a"]}\n', "def f():", "x = [", "the pet is a "]


def _grammars() -> dict[str, str]:
    def fmt(body: dict[str, Any]) -> str:
        grammar = grammar_of(ResponseFormat.model_validate(body))
        assert grammar is not None
        return grammar

    call = tool_grammar(
        ChatCompletionRequest.model_validate(
            {
                "model": "m",
                "messages": [{"role": "user", "content": "x"}],
                "tools": [{"type": "function", "function": {"name": "adopt", "parameters": PET}}],
                "tool_choice": "required",
                "parallel_tool_calls": False,
            }
        )
    )
    assert call is not None
    return {
        "pet": fmt({"type": "json_schema", "json_schema": {"name": "Pet", "schema": PET}}),
        "object": fmt({"type": "json_object"}),
        "choice": fmt({"type": "choice", "choice": ["alpha beta gamma", "alpha beta delta", "omega"]}),
        "call": call,
    }


@pytest.fixture(scope="module")
def layout(tiny_zoo: Path) -> ZooLayout:
    return ZooLayout(tiny_zoo)


def test_forced_token_is_the_one_token_the_mask_allows_and_its_mask_is_reused(layout: ZooLayout) -> None:
    gt: GrammarTokenizer = LocalLM(layout.artifact_dir("lm-edge-onnx-int8")).grammar_tokenizer()
    rng = np.random.default_rng(11)
    forced_steps = free_steps = 0
    for grammar in _grammars().values():
        for _ in range(3):  # random paths through the grammar
            constraint, path = gt.constraint(grammar), list[int]()
            while not constraint.done and len(path) < 60:
                forced = constraint.forced_token()  # computes the mask and keeps it for the step
                kept = np.zeros((1, constraint.num_words), dtype=np.int32)
                fill_bitmasks([constraint], kept)  # the kept mask, copied
                fresh = Constraint(gt, grammar)
                assert fresh._matcher.consume_tokens(path)
                recomputed = np.zeros_like(kept)
                fill_bitmasks([fresh], recomputed)
                assert (kept == recomputed).all()
                allowed = np.flatnonzero(constraint.mask())
                if len(allowed) == 1 and allowed[0] not in gt.eos_token_ids:
                    assert forced == allowed[0]
                    forced_steps += 1
                else:
                    assert forced is None
                    free_steps += 1
                path.append(int(rng.choice(allowed)))
                constraint.accept(path[-1])
    assert forced_steps >= 10 and free_steps >= 10, (forced_steps, free_steps)


def _generate(llm: LLM, prompts: list[str], params: list[SamplingParams]) -> tuple[list[Any], int]:
    steps = llm.engine.stats.num_steps
    outs = llm.generate(prompts, params)
    return [
        [(c.token_ids, c.finish_reason, c.text) for c in o.outputs] for o in outs
    ], llm.engine.stats.num_steps - steps


def test_cloud_jump_forward_gives_the_token_by_token_output_in_fewer_steps(layout: ZooLayout) -> None:
    lm_dir = layout.artifact_dir("lm-cloud")
    grammars = _grammars()
    by_token = LLM(lm_dir, kv_cache_bytes=KV, grammar_jump_forward=False)
    jumping = LLM(lm_dir, kv_cache_bytes=KV)
    speculating = LLM(lm_dir, kv_cache_bytes=KV, speculation="ngram", adaptive_speculation=False)
    for name, grammar in grammars.items():
        params = SamplingParams(temperature=0.0, max_tokens=80, grammar=grammar)
        for prompt in PROMPTS:  # one at a time: steps count forwards
            expected, steps_by_token = _generate(by_token, [prompt], [params])
            got, steps_jumping = _generate(jumping, [prompt], [params])
            assert got == expected, (name, prompt)
            assert steps_jumping <= steps_by_token
            assert _generate(speculating, [prompt], [params])[0] == expected, (name, prompt, "ngram")
    # All of them in one batch, beside free requests and an n > 1 request: each as it decodes alone.
    prompts = PROMPTS * 2
    batch = [SamplingParams(temperature=0.0, max_tokens=80, grammar=g) for g in grammars.values()] * 2
    batch[1] = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    batch[5] = SamplingParams(temperature=0.0, max_tokens=60, grammar=grammars["pet"], n=2)
    expected, steps_by_token = _generate(by_token, prompts, batch)
    got, steps_jumping = _generate(jumping, prompts, batch)
    assert got == expected
    # The pet schema's keys are forced: a single pet request takes fewer forwards than tokens.
    pet = SamplingParams(temperature=0.0, max_tokens=80, grammar=grammars["pet"])
    (((tokens, reason, text),),), steps = _generate(jumping, [PROMPTS[0]], [pet])
    assert reason == "stop" and text.startswith('{"name":"')
    assert steps < len(tokens) - 5, (steps, len(tokens))


def test_requests_that_need_every_tokens_logits_decode_token_by_token(layout: ZooLayout) -> None:
    llm = LLM(layout.artifact_dir("lm-cloud"), kv_cache_bytes=KV)
    pet = _grammars()["pet"]
    params = SamplingParams(temperature=0.0, max_tokens=80, grammar=pet, logprobs=2)
    (((tokens, _, _),),), steps = _generate(llm, [PROMPTS[0]], [params])
    out = llm.generate([PROMPTS[0]], params)[0].outputs[0]
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids) == len(tokens)
    assert steps == len(tokens)  # one forward a token: each token's logprob is the model's
    seeded = SamplingParams(temperature=0.8, seed=5, max_tokens=60, grammar=pet)
    (((tokens, _, _),),), steps = _generate(llm, [PROMPTS[0]], [seeded])
    assert steps == len(tokens)  # a seeded draw for each token, as without jump-forward


@pytest.mark.parametrize("model", ["lm-edge-onnx", "lm-edge-tflite", "lm-edge-onnx-int8"])
def test_edge_jump_forward_gives_the_token_by_token_output_in_fewer_model_calls(layout: ZooLayout, model: str) -> None:
    """INT8 (dynamic quantization: a call's activations share one scale, so a token's numbers depend on the tokens
    run with it) keeps one call a token: the same output, no fewer calls."""
    lm = LocalLM(layout.artifact_dir(model))
    assert lm.runtime.exact_chunks == (model != "lm-edge-onnx-int8")
    calls = {"n": 0}
    for name in ("prefill", "decode"):
        original = getattr(lm.runtime, name)

        def counted(*args: Any, _original: Any = original) -> Any:
            calls["n"] += 1
            return _original(*args)

        setattr(lm.runtime, name, counted)

    def run(grammar: str, prompt: str, jump: bool) -> tuple[list[tuple[int, str, str | None]], int]:
        lm.jump_forward = jump
        before = calls["n"]
        req = LocalRequest(lm.tokenizer.encode(prompt), max_tokens=80, temperature=0.0, grammar=grammar)
        steps = [(s.token_id, s.delta_text, s.finish_reason) for s in lm.generate(req)]
        return steps, calls["n"] - before

    fewer = 0
    for name, grammar in _grammars().items():
        for prompt in PROMPTS:
            expected, calls_by_token = run(grammar, prompt, False)
            got, calls_jumping = run(grammar, prompt, True)
            assert got == expected, (model, name, prompt)
            assert calls_jumping <= calls_by_token if lm.runtime.exact_chunks else calls_jumping == calls_by_token
            fewer += calls_jumping < calls_by_token
    assert fewer >= 4 if lm.runtime.exact_chunks else fewer == 0, fewer
