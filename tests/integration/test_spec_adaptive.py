"""Adaptive speculation on the test zoo's LMs: greedy outputs equal plain decoding's under every method, the
controller's costs are the engine's own steps (plain and speculative, per concurrency), and the steps speculation
adds (the draft's, the verification) take the fused CPU step."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from cloud.engine import LLM, SamplingParams
from cloud.engine.fused_decoder import FusedDecoder
from cloud.engine.model_runner import process_threads, set_process_threads
from shared.zoo.registry import ZooLayout
from tests.host_stat import busy_host

PROMPTS = ["def main(argv):\n", "import os\n\n\nclass Config:\n    ", "    for i in range(len(", "# Copyright"]
KV = 16 << 20


@pytest.fixture(scope="module")
def lm_dirs(tiny_zoo: Path) -> tuple[Path, Path]:
    layout = ZooLayout(tiny_zoo)
    return layout.artifact_dir("lm-cloud"), layout.artifact_dir("lm-draft")


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _count_fused(decoder: FusedDecoder | None) -> list[int]:
    """Rows of every fused call from now on."""
    assert decoder is not None, "the fused decode step did not build (see the log)"
    rows: list[int] = []
    run = decoder.run

    def counted(token_ids: list[int], *args: Any) -> torch.Tensor:
        rows.append(len(token_ids))
        return run(token_ids, *args)

    decoder.run = counted  # type: ignore[method-assign,assignment]
    return rows


@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_adaptive_speculation_gives_plain_outputs_and_measures_the_steps_it_runs(
    lm_dirs: tuple[Path, Path], method: str
) -> None:
    base = [o.token_ids for o in LLM(lm_dirs[0], kv_cache_bytes=KV).generate(PROMPTS, greedy(48))]
    kwargs: dict[str, Any] = {"draft_model_dir": lm_dirs[1]} if method == "draft" else {"speculation": "ngram"}
    llm = LLM(lm_dirs[0], kv_cache_bytes=KV, **kwargs)
    together = [o.token_ids for o in llm.generate(PROMPTS, greedy(48))]
    alone = [llm.generate(p, greedy(48))[0].token_ids for p in PROMPTS]
    assert together == base and alone == base
    spec = llm.engine.spec
    assert spec is not None and spec.adaptive
    # Plain steps were timed at both concurrencies (each bucket starts plain), and so was speculation somewhere.
    assert spec.cost(method, 1, 0) is not None and spec.cost(method, 4, 0) is not None
    assert any(spec.cost(method, n, k) is not None for n in (1, 4) for k in range(1, spec.max_k + 1))


def test_the_draft_and_the_verification_take_the_fused_step(lm_dirs: tuple[Path, Path]) -> None:
    llm = LLM(lm_dirs[0], kv_cache_bytes=KV, draft_model_dir=lm_dirs[1], adaptive_speculation=False)
    engine = llm.engine
    assert engine.draft_runner is not None
    target_rows = _count_fused(engine.runner.fused_decoder)
    draft = engine.draft_runner.fused_decoder
    assert draft is not None and draft.greedy_fn is not None
    rounds: list[list[int]] = []
    propose = draft.propose_greedy

    def counted(*args: Any) -> list[list[int]]:
        rounds.append(args[-1])
        return propose(*args)

    draft.propose_greedy = counted  # type: ignore[method-assign,assignment]
    outs = llm.generate(PROMPTS[:1], greedy(40))
    k = engine.config.num_speculative_tokens
    assert engine.stats.spec_proposed["draft"] > 0 and len(outs[0].token_ids) == 40
    assert target_rows.count(k + 1) >= 5  # verifications of k proposals, one C call each
    assert rounds.count([k]) >= 5  # the draft's k greedy steps a round: one C call


def test_the_warm_up_runs_each_path_before_serving_and_keeps_nothing(lm_dirs: tuple[Path, Path]) -> None:
    """A first forward pays one-off costs the controller would take for a step's; the engine runs each path once at
    load (the draft's and the target's: prefill, decode alone and batched, a verification), then serves as if it had
    not: no KV block held, no step counted, no cost measured, and greedy outputs equal plain decoding's, although
    the warm-up wrote into the blocks the requests then take."""
    cold = LLM(lm_dirs[0], kv_cache_bytes=KV, draft_model_dir=lm_dirs[1], warm_up=False).engine
    assert cold.runner.num_forwards == 0 and cold.draft_runner is not None and cold.draft_runner.num_forwards == 0
    llm = LLM(lm_dirs[0], kv_cache_bytes=KV, draft_model_dir=lm_dirs[1])
    engine = llm.engine
    assert engine.draft_runner is not None
    assert engine.runner.num_forwards == 4 and engine.draft_runner.num_forwards == 4
    spec = engine.spec
    assert spec is not None and spec.catch_up_cost(1000) == 0.0
    assert all(spec.cost("draft", n, k) is None for n in (1, 16) for k in range(spec.max_k + 1))
    assert engine.stats.num_steps == 0
    assert engine.block_manager.num_free_blocks == engine.num_blocks
    base = [o.token_ids for o in LLM(lm_dirs[0], kv_cache_bytes=KV).generate(PROMPTS, greedy(32))]
    assert [o.token_ids for o in llm.generate(PROMPTS, greedy(32))] == base
    assert spec.catch_up_cost(1000) > 0.0  # the draft caught up on the prompts, and that was measured


def test_an_engine_built_after_another_ran_steps_gets_the_processs_threads(
    lm_dirs: tuple[Path, Path], tmp_path: Path
) -> None:
    """torch's thread count is the process's, and a small step (or any, on a busy host) runs on one thread: an engine
    built after another had run one (a warm-up does) took that one thread for its large steps too — in ``bench spec``
    the n-gram engine, built after the draft engine's warm-up, ran 64 concurrent requests on one core of two (0.77x
    plain)."""
    if (os.cpu_count() or 1) < 2:
        pytest.skip("one CPU on this host: nothing for a small step to narrow")
    before = process_threads()
    set_process_threads(2)  # (an earlier test in this worker may have left the process on one thread)
    try:
        first = LLM(lm_dirs[0], kv_cache_bytes=KV, draft_model_dir=lm_dirs[1])  # warms up: small steps, one thread
        assert first.engine.runner.max_threads == 2
        for runner in (first.engine.runner, first.engine.draft_runner):  # (the steps below narrow them to one)
            assert runner is not None
            runner.host_load = busy_host(tmp_path / "stat")
        first.generate(PROMPTS[:1], greedy(4))
        assert torch.get_num_threads() == 1  # what the last small step left
        second = LLM(lm_dirs[0], kv_cache_bytes=KV, speculation="ngram")
        assert second.engine.runner.max_threads == 2
    finally:
        set_process_threads(before)
