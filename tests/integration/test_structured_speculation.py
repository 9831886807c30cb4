"""Speculative decoding under a grammar (``response_format``, tool calls): proposals are cut before the first
token the grammar refuses and each verification row is masked by the grammar's state after the proposals before
it, so constrained greedy output with a draft model or n-grams equals plain constrained greedy, token for token,
and sampled output still matches the grammar."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import pytest
from pydantic import BaseModel, Field

from cloud.engine import LLM, SamplingParams
from shared.openai_schema import ChatCompletionRequest, ResponseFormat
from shared.structured import grammar_of
from shared.tools import grammar as tool_grammar
from shared.tools import parse_calls
from shared.zoo.registry import ZooLayout

KV = 16 << 20
EXAMPLE = '{"name":"Rex","kind":"dog","age":3,"vaccinated":true}'
PROMPTS = [f"pets: {EXAMPLE}\n{EXAMPLE}\n", f"one pet: {EXAMPLE} and ", "def f():"]


class Pet(BaseModel):
    name: str = Field(max_length=8)
    kind: Literal["cat", "dog", "fish"]
    age: int = Field(ge=0, le=30)
    vaccinated: bool


PET = {**Pet.model_json_schema(), "additionalProperties": False}


@pytest.fixture(scope="module")
def lm_dirs(tiny_zoo: Path) -> tuple[Path, Path]:
    layout = ZooLayout(tiny_zoo)
    return layout.artifact_dir("lm-cloud"), layout.artifact_dir("lm-draft")


def _grammars() -> dict[str, str]:
    pet = grammar_of(
        ResponseFormat.model_validate({"type": "json_schema", "json_schema": {"name": "Pet", "schema": PET}})
    )
    tools = ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "x"}],
            "tools": [{"type": "function", "function": {"name": "adopt", "parameters": PET}}],
            "tool_choice": "required",
            "parallel_tool_calls": False,  # greedy would repeat calls up to the limit
        }
    )
    call = tool_grammar(tools)
    assert pet is not None and call is not None
    return {"pet": pet, "call": call}


def test_speculative_constrained_greedy_is_plain_constrained_greedy_and_valid(lm_dirs: tuple[Path, Path]) -> None:
    plain = LLM(lm_dirs[0], kv_cache_bytes=KV)
    grammars = _grammars()
    expected = {
        name: [o.token_ids for o in plain.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=120, grammar=g))]
        for name, g in grammars.items()
    }
    for kwargs in ({"draft_model_dir": lm_dirs[1]}, {"speculation": "ngram"}):
        spec = LLM(lm_dirs[0], kv_cache_bytes=KV, adaptive_speculation=False, **kwargs)
        for name, g in grammars.items():
            outs = spec.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=120, grammar=g))
            assert [o.token_ids for o in outs] == expected[name], (kwargs, name)
            for o in outs:
                assert o.finish_reason == "stop", (kwargs, name, o.text)
                if name == "pet":
                    Pet.model_validate_json(o.text)
                else:
                    assert [n for n, _ in parse_calls(o.text) or []][:1] == ["adopt"], o.text
        method = "draft" if "draft_model_dir" in kwargs else "ngram"
        stats = spec.engine.stats
        assert stats.spec_proposed.get(method, 0) > 0 and stats.spec_accepted.get(method, 0) > 0, (method, stats)


def test_speculative_constrained_sampling_still_matches_the_grammar(lm_dirs: tuple[Path, Path]) -> None:
    spec = LLM(lm_dirs[0], draft_model_dir=lm_dirs[1], kv_cache_bytes=KV, adaptive_speculation=False)
    params = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=120, grammar=_grammars()["pet"], n=2)
    outs = spec.generate(PROMPTS, params)  # unseeded: seeded sampled requests decode plainly
    for out in outs:
        for c in out.outputs:
            assert c.finish_reason == "stop", c.text
            Pet.model_validate_json(c.text)
    assert spec.engine.stats.spec_proposed.get("draft", 0) > 0
