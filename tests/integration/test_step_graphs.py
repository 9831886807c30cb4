"""Decode and verification steps as ``StepGraphs`` runs them: padded to a captured shape (dummy sequences in a pad
block, tables padded to a power of two of blocks) on static inputs. On CPU the padded step runs eagerly (no CUDA
graph), which checks everything but the capture against transformers, for every family the engine serves; on a CUDA
device the same steps are captured and replayed (those tests skip without one)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from cloud.engine import step_graphs
from cloud.engine.config import EngineConfig
from cloud.engine.llm_engine import LLMEngine
from cloud.engine.model_runner import Feed, ModelRunner
from cloud.engine.sampling_params import SamplingParams
from shared.zoo.registry import ZooLayout
from tests.integration.test_engine_oracle import ATOL, BLOCK, CASES, _save

NUM_BLOCKS = 64
PAD = NUM_BLOCKS - 1  # (no table below uses it)
GRAPH_CASES = sorted(c for c in CASES if c != "llama-rope-dynamic")
pytestmark = pytest.mark.integration
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: CUDA graphs are captured only there")


def _runner(path: Path, graphs: bool, device: str = "cpu") -> ModelRunner:
    runner = ModelRunner(
        path, torch.device(device), torch.float32, BLOCK, num_blocks=NUM_BLOCKS, max_model_len=128, cuda_graphs=graphs
    )
    runner.fused_decoder = None
    runner.attention_kernel = None  # torch's gather and SDPA: the path the graphs pad
    if graphs and device == "cpu":
        assert runner.graphs is None  # (captured only on CUDA: installed here to run the padded step eagerly)
        runner.graphs = step_graphs.StepGraphs(runner.model, runner.kv_caches, BLOCK, PAD, 16, 64, capture=False)
    return runner


def _hf_step_logits(hf: Any, prompt: list[int], fed: list[int]) -> torch.Tensor:
    """transformers' logits at each of ``fed``'s tokens, after ``prompt`` in its KV cache."""
    with torch.no_grad():
        cache = hf(torch.tensor([prompt]), use_cache=True).cache
        return hf(torch.tensor([fed]), cache=cache, use_cache=True).logits[0]


@pytest.mark.parametrize("case", GRAPH_CASES)
def test_padded_decode_and_verification_steps_match_transformers(tmp_path: Path, case: str) -> None:
    """Three sequences of different lengths (padded to 4, tables to a power of two of blocks): a decode step, then a
    verification of 3 proposals each, give transformers' logits, and the dummy rows leave the real caches alone (the
    verification after the decode reads the decode's K/V)."""
    hf, path = _save(tmp_path, case)
    runner = _runner(path, graphs=True)
    graphs = runner.graphs
    assert graphs is not None
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (21, 6, 12)]
    tables = [[20, 3, 22], [0], [10, 41]]  # (deliberately out of order)
    runner.execute([Feed(t, p[:-1], 0, 0) for t, p in zip(tables, prompts, strict=True)])
    decode = runner.execute([Feed(t, p[-1:], len(p) - 1, 1) for t, p in zip(tables, prompts, strict=True)])
    assert graphs.shape_of([Feed(t, p[-1:], len(p) - 1, 1) for t, p in zip(tables, prompts, strict=True)]) == (4, 1, 4)
    fed = [torch.randint(0, 256, (4,), generator=gen).tolist() for _ in prompts]
    tables[0].append(30)  # (the verifications of the first two cross into a new block)
    tables[1].append(5)
    verify = runner.execute([Feed(t, f, len(p), 4) for t, p, f in zip(tables, prompts, fed, strict=True)])
    assert len(graphs._shapes) == 2  # both steps ran padded, not eagerly
    assert verify.shape == (12, 256)
    for i, (p, f) in enumerate(zip(prompts, fed, strict=True)):
        expected = _hf_step_logits(hf, p[:-1], p[-1:] + f)
        torch.testing.assert_close(decode[i], expected[0], atol=ATOL, rtol=0)
        torch.testing.assert_close(verify[4 * i : 4 * i + 4], expected[1:], atol=ATOL, rtol=0)


def test_steps_not_of_a_graphs_kind_run_eagerly_and_rows_come_back_as_asked(tmp_path: Path) -> None:
    """A prompt, feeds of different lengths, more tokens than a block: eager (None from the graphs); a step wanting
    the last row of some feeds and every row of others gets exactly those rows, in feed order."""
    _, path = _save(tmp_path, "llama-gqa")
    runner = _runner(path, graphs=True)
    eager = _runner(path, graphs=False)
    graphs = runner.graphs
    assert graphs is not None and eager.graphs is None
    assert graphs.shape_of([Feed([0, 1, 2], list(range(BLOCK + 1)), 0, 1)]) is None  # over a block
    assert graphs.shape_of([Feed([0], [1, 2], 0, 2), Feed([1], [1], 0, 1)]) is None  # Q 2 beside Q 1
    assert graphs.shape_of([Feed([0], [1], 0, 2)]) is None  # more logits than tokens
    assert graphs.shape_of([Feed([0], [1], 0, 1)] * 65) is None  # past the engine's sequences
    fifty = step_graphs.StepGraphs(runner.model, runner.kv_caches, BLOCK, PAD, 16, 50, capture=False)
    assert fifty.shape_of([Feed([0], [1], 0, 1)] * 50) == (64, 1, 1)  # (a max_num_seqs of 50: up to its bucket)
    assert graphs.shape_of([Feed(list(range(16)), [1], 120, 1)]) == (1, 1, 16)
    prompts = [[7, 8, 9, 10, 11], [3, 4, 5]]
    for r in (runner, eager):
        r.execute([Feed([i], p, 0, 0) for i, p in enumerate(prompts)])
    feeds = [Feed([0, 6], [12, 13, 14], 5, 1), Feed([1], [6, 7, 8], 3, 3)]
    got, expected = runner.execute(feeds), eager.execute(feeds)
    assert got.shape == (4, 256)
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


def test_models_whose_forward_reads_a_value_on_the_host_are_not_captured(tmp_path: Path) -> None:
    _, path = _save(tmp_path, "llama-rope-dynamic")
    runner = ModelRunner(path, torch.device("cpu"), torch.float32, BLOCK, num_blocks=8, max_model_len=64)
    assert not step_graphs.supports(runner.model)
    _, path = _save(tmp_path, "mistral-window")
    assert step_graphs.supports(ModelRunner(path, torch.device("cpu"), torch.float32, BLOCK, 8, 64).model)


def _pad_steps(runner: ModelRunner) -> None:
    """``runner``'s steps padded as on CUDA, run eagerly: its cache one block longer (the pad block, past the block
    manager's), the fused C step and the CPU attention kernel off."""
    shape = list(runner.kv_cache.shape)
    shape[2] += 1
    runner.kv_cache = torch.zeros(shape, dtype=runner.kv_cache.dtype)
    runner.kv_caches = [(runner.kv_cache[i, 0], runner.kv_cache[i, 1]) for i in range(shape[0])]
    runner.fused_decoder = None
    runner.attention_kernel = None
    max_blocks = runner.model.max_positions // runner.block_size
    runner.graphs = step_graphs.StepGraphs(
        runner.model, runner.kv_caches, runner.block_size, runner.num_blocks, max_blocks, 64, capture=False
    )


def _decode(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> dict[str, list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return done


def test_an_engine_whose_steps_are_padded_speculates_and_decodes_the_same_tokens(tiny_zoo: Path) -> None:
    """The engine with draft speculation, its target's and draft's steps padded (eagerly, on CPU): the greedy tokens
    of the engine as it runs on CPU, its verifications through the padded shapes."""
    zoo = ZooLayout(tiny_zoo)
    config = EngineConfig(
        zoo.artifact_dir("lm-cloud"), draft_model_dir=zoo.artifact_dir("lm-draft"), adaptive_speculation=False
    )
    prompts = [list(range(5, 5 + n)) for n in (7, 19, 30)]
    expected = _decode(LLMEngine(config), prompts, 20)
    engine = LLMEngine(config)
    assert engine.draft_runner is not None
    _pad_steps(engine.runner)
    _pad_steps(engine.draft_runner)
    assert _decode(engine, prompts, 20) == expected
    graphs = engine.runner.graphs
    assert graphs is not None and {q for _, q, _ in graphs._shapes} >= {config.num_speculative_tokens + 1}
    assert engine.stats.spec_steps.get("draft", 0) > 0


@cuda
@pytest.mark.parametrize("case", ["llama-gqa", "qwen3-bias-window", "gemma2-softcaps", "phi3-longrope-partial-window"])
def test_captured_steps_replay_the_eager_steps_logits_on_cuda(tmp_path: Path, case: str) -> None:
    """On a GPU: decode and verification steps captured once, then replayed with other sequences' inputs, give the
    eager path's logits; the pad block is past the block manager's blocks."""
    _, path = _save(tmp_path, case)
    runner, eager = _runner(path, graphs=True, device="cuda"), _runner(path, graphs=False, device="cuda")
    graphs = runner.graphs
    assert graphs is not None and graphs.capture and graphs.pad_block == NUM_BLOCKS
    assert runner.kv_cache.shape[2] == NUM_BLOCKS + 1
    gen = torch.Generator().manual_seed(6)
    for round_ in range(3):  # round 0 captures, the rest replay with new contents
        prompts = [torch.randint(0, 256, (n + round_,), generator=gen).tolist() for n in (9, 17, 4)]
        tables = [[3 * i + 10 * round_, 3 * i + 1 + 10 * round_, 3 * i + 2 + 10 * round_] for i in range(3)]
        for r in (runner, eager):
            r.execute([Feed(t, p, 0, 0) for t, p in zip(tables, prompts, strict=True)])
        for q in (1, 4):
            fed = [torch.randint(0, 256, (q,), generator=gen).tolist() for _ in prompts]
            feeds = [Feed(t, f, len(p), q) for t, p, f in zip(tables, prompts, fed, strict=True)]
            torch.testing.assert_close(runner.execute(feeds), eager.execute(feeds), atol=1e-4, rtol=0)
    assert graphs.num_captures == 2 and graphs.num_replays == 6


@cuda
def test_an_engine_on_cuda_decodes_and_speculates_from_graphs_with_the_eager_engines_tokens(tiny_zoo: Path) -> None:
    zoo = ZooLayout(tiny_zoo)
    target, draft = zoo.artifact_dir("lm-cloud"), zoo.artifact_dir("lm-draft")
    outputs: dict[bool, dict[str, list[int]]] = {}
    for eager in (False, True):
        config = EngineConfig(
            target, draft_model_dir=draft, device="cuda", kv_cache_bytes=16 << 20, enforce_eager=eager
        )
        engine = LLMEngine(config)
        assert (engine.runner.graphs is None) == eager
        outputs[eager] = _decode(engine, [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15]], 24)
        if not eager:
            assert engine.runner.graphs is not None and engine.runner.graphs.num_replays > 0
    assert outputs[False] == outputs[True]
