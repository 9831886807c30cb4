"""The engine step's CPU fast paths: small steps on one thread, RoPE in fewer ops, the same numbers."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from cloud.engine import EngineConfig, SamplingParams
from cloud.engine.llm_engine import LLMEngine
from cloud.engine.model import apply_rotary, rotary_factors
from cloud.engine.model_runner import PARALLEL_MIN_MACS, Feed
from shared.zoo.registry import ZooLayout


@pytest.fixture
def two_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture
def engine(tiny_zoo: Path, two_threads: None) -> LLMEngine:
    return LLMEngine(EngineConfig(ZooLayout(tiny_zoo).artifact_dir("lm-cloud"), kv_cache_bytes=16 << 20, num_threads=2))


def test_a_decode_step_runs_on_one_thread_and_a_long_prefill_on_all(engine: LLMEngine) -> None:
    runner = engine.runner
    prompt = list(range(5, 5 + 200))
    assert runner.step_macs([Feed(list(range(13)), prompt, 0, 1)]) >= PARALLEL_MIN_MACS
    runner.execute([Feed(list(range(13)), prompt, 0, 1)])
    assert torch.get_num_threads() == 2
    runner.execute([Feed(list(range(13)), [7], 200, 1)])
    assert torch.get_num_threads() == 1  # what the forward (and the kernel, which follows torch) ran on
    runner.execute([Feed(list(range(13, 26)), prompt, 0, 1)])
    assert torch.get_num_threads() == 2


def test_outputs_do_not_depend_on_the_thread_switch(engine: LLMEngine) -> None:
    """A request decoded alone (one thread) and among 40 others (all threads) gets the same greedy tokens."""
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = [list(range(10 + i, 60 + i)) for i in range(41)]
    engine.add_request("alone", prompts[0], params, cache_salt="a")
    alone: list[int] = []
    while engine.has_unfinished_requests():
        alone += [t for out in engine.step() if out.finished for t in out.token_ids]
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params, cache_salt="b")
    crowd: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        crowd.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    assert crowd["r0"] == alone and len(alone) == 24


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_in_four_ops_is_rotate_half(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(7, 6, 32, generator=gen).to(dtype)
    angles = torch.randn(7, 16, generator=gen)
    cos, sin = angles.cos(), angles.sin()
    x1, x2 = x.float().chunk(2, dim=-1)
    c, s = cos[:, None, :], sin[:, None, :]
    expected = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(dtype)
    assert torch.equal(apply_rotary(x, *rotary_factors(cos, sin)), expected)
