"""The engine step's CPU fast paths: small steps on one thread, RoPE in fewer ops, small decode steps as one fused
C call; the same numbers (greedy tokens)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from tokenizers import Tokenizer

from cloud.engine import EngineConfig, SamplingParams
from cloud.engine.host_load import HostLoad
from cloud.engine.llm_engine import LLMEngine
from cloud.engine.model import apply_rotary, rotary_factors
from cloud.engine.model_runner import FUSED_PARALLEL_MIN_MACS, PARALLEL_MIN_MACS, Feed, ModelRunner
from shared.zoo.build import committed_weights
from shared.zoo.corpus import held_out_files
from shared.zoo.presets import DEMO
from shared.zoo.registry import ZooLayout
from tests.host_stat import busy_host, idle_host


@pytest.fixture
def two_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture
def engine(tiny_zoo: Path, two_threads: None) -> LLMEngine:
    return LLMEngine(EngineConfig(ZooLayout(tiny_zoo).artifact_dir("lm-cloud"), kv_cache_bytes=16 << 20, num_threads=2))


def test_a_step_takes_the_cores_the_host_leaves_idle(engine: LLMEngine, tiny_zoo: Path, tmp_path: Path) -> None:
    """On a host with an idle second core, a long prefill and a fused decode of a model large enough
    (``FUSED_PARALLEL_MIN_MACS``) run on both threads; with the other core busy, on one; a decode of a model below
    that size runs on one either way; where the host's load cannot be read, the size rule (``PARALLEL_MIN_MACS``)."""
    runner = engine.runner
    prompt = list(range(5, 5 + 200))
    decode = Feed(list(range(13)), [7], 200, 1)
    assert runner.step_macs([Feed(list(range(13)), prompt, 0, 1)]) >= PARALLEL_MIN_MACS
    assert FUSED_PARALLEL_MIN_MACS <= runner.step_macs([decode]) < PARALLEL_MIN_MACS
    assert runner.fuses([decode])
    seen: list[int] = []
    for load in (idle_host(tmp_path / "idle"), busy_host(tmp_path / "busy"), HostLoad(stat_path=tmp_path / "none")):
        runner.host_load = load
        runner.execute([Feed(list(range(13)), prompt, 0, 1)])
        seen.append(torch.get_num_threads())
        runner.execute([decode])
        seen.append(torch.get_num_threads())  # what the step (and the kernel, which follows torch) ran on
    assert seen == [2, 2, 1, 1, 2, 1]
    small = LLMEngine(
        EngineConfig(ZooLayout(tiny_zoo).artifact_dir("lm-edge"), kv_cache_bytes=16 << 20, num_threads=2)
    ).runner
    small.host_load = idle_host(tmp_path / "idle-small")
    assert small.step_macs([decode]) < FUSED_PARALLEL_MIN_MACS and small.fuses([decode])
    small.execute([decode])
    assert torch.get_num_threads() == 1


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


DEMO_LM = committed_weights(DEMO) / "lm-cloud"


def _greedy_tokens(fused: bool, prompts: list[list[int]], max_tokens: int) -> tuple[dict[str, list[int]], int]:
    """Every prompt decoded (all at once after the first, alone) by an engine with or without the fused decode
    step; returns each request's tokens and how many steps took the fused path."""
    engine = LLMEngine(
        EngineConfig(DEMO_LM, kv_cache_bytes=32 << 20, num_threads=2, fused_decode=fused, decode_burst_ms=0.0)
    )
    assert (engine.runner.fused_decoder is not None) == fused, "the fused decode step did not build (see the log)"
    calls = 0
    if engine.runner.fused_decoder is not None:
        run = engine.runner.fused_decoder.run

        def counted(*args: Any) -> torch.Tensor:
            nonlocal calls
            calls += 1
            return run(*args)

        engine.runner.fused_decoder.run = counted  # type: ignore[method-assign,assignment]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    tokens: dict[str, list[int]] = {}
    for group in (prompts[:1], prompts[1:]):
        for p in group:
            engine.add_request(f"r{prompts.index(p)}", p, params)
        while engine.has_unfinished_requests():
            tokens.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    return tokens, calls


def test_the_fused_decode_step_gives_the_torch_models_greedy_tokens(two_threads: None) -> None:
    """The demo cloud LM on held-out text: one request alone and three together (decode steps of one to three
    sequences, below the one-thread threshold, all fused) get the same greedy tokens with the fused step as through
    the torch model."""
    tokenizer = Tokenizer.from_file(str(DEMO_LM / "tokenizer.json"))
    texts = [f.text for f in held_out_files()[:4]]
    prompts = [tokenizer.encode(t).ids[: 40 + 23 * i] for i, t in enumerate(texts)]
    assert all(len(p) >= 40 for p in prompts)
    fused, calls = _greedy_tokens(True, prompts, 64)
    reference, _ = _greedy_tokens(False, prompts, 64)
    assert calls >= 2 * 63  # the lone request's decode steps and the group's
    assert fused == reference and all(len(t) == 64 for t in fused.values())


def test_the_fused_step_refuses_what_the_torch_model_would() -> None:
    """The C code trusts its indices, so the binding checks them: a token past the vocabulary, a position past the
    RoPE table or one its block table does not reach are refused, not read out of bounds."""
    runner = ModelRunner(DEMO_LM, torch.device("cpu"), torch.float32, 16, num_blocks=8, max_model_len=64)
    fused = runner.fused_decoder
    assert fused is not None
    assert fused.run([5], [3], [[0]]).shape == (1, runner.config.vocab_size)
    with pytest.raises(ValueError, match="token ids"):
        fused.run([runner.config.vocab_size], [3], [[0]])
    with pytest.raises(ValueError, match="past the model's 64 positions"):
        fused.run([5], [64], [[0, 1, 2, 3, 4]])
    with pytest.raises(ValueError, match="does not cover"):
        fused.run([5], [16], [[0]])
    with pytest.raises(ValueError, match=r"block ids must be in \[0, 8\)"):
        fused.run([5], [3], [[8]])
