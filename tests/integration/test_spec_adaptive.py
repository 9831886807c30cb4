"""Adaptive speculation on the test zoo's LMs: greedy outputs equal plain decoding's under every method, the
controller's costs are the engine's own steps (plain and speculative, per concurrency), and the steps speculation
adds (the draft's, the verification) take the fused CPU step."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from cloud.engine import LLM, SamplingParams
from cloud.engine.fused_decoder import FusedDecoder
from shared.zoo.registry import ZooLayout

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
    draft_rows = _count_fused(engine.draft_runner.fused_decoder)
    outs = llm.generate(PROMPTS[:1], greedy(40))
    k = engine.config.num_speculative_tokens
    assert engine.stats.spec_proposed["draft"] > 0 and len(outs[0].token_ids) == 40
    assert target_rows.count(k + 1) >= 5  # verifications of k proposals, one C call each
    assert len(draft_rows) >= 5 * k  # the draft's k steps a round
