"""``python -m bench.lab.spec_probe``: the batch-1 arithmetic of speculation (tokens a round per k, forward costs) on
the tiny zoo, with a few steps of Medusa-style heads."""

from __future__ import annotations

from pathlib import Path

import pytest

from shared.zoo.registry import ZooLayout

pytestmark = pytest.mark.integration


def test_the_probe_walks_the_targets_own_greedy_continuations(tiny_zoo: Path) -> None:
    from bench.lab.spec_probe import probe

    lm_dir = ZooLayout(tiny_zoo).artifact_dir("lm-cloud").parent
    result = probe(lm_dir, max_k=3, head_k=2, head_steps=3, eval_prompts=4, train_prompts=4)
    # What the walk replays is what speculation would see: the engine's greedy tokens are transformers' argmax.
    assert result["target_argmax_is_engine_greedy"] is True
    per_k = result["per_k"]
    assert set(per_k) == {"1", "2", "3"}
    tokens = [per_k[str(k)]["draft_tokens_per_round"] for k in (1, 2, 3)]
    assert all(1.0 <= t <= k + 1 for k, t in zip((1, 2, 3), tokens, strict=True))
    assert result["plain_forward_ms"] > 0 and result["draft_cost_ratio"] > 0
    assert all(per_k[str(k)]["verify_ms"] > 0 for k in (1, 2, 3))
    # No proposer beats one that is always right and costs nothing: the ceiling is above every draft's bound.
    for k in (1, 2, 3):
        row = per_k[str(k)]
        assert row["oracle_forward_bound_speedup"] >= row["draft_forward_bound_speedup"]
        oracle = (k + 1) * result["plain_forward_ms"] / row["verify_ms"]
        assert row["oracle_forward_bound_speedup"] == pytest.approx(oracle, rel=0.05)
    assert result["oracle_bound_speedup"] == max(per_k[str(k)]["oracle_forward_bound_speedup"] for k in (1, 2, 3))
    assert result["verified_row_ms"] == pytest.approx((per_k["3"]["verify_ms"] - per_k["1"]["verify_ms"]) / 2, abs=2e-3)
    medusa = result["medusa"]
    assert medusa["heads"] == 2 and len(medusa["head_top1_accuracy"]) == 2
    assert all(0.0 <= a <= 1.0 for a in medusa["head_top1_accuracy"])
    assert 1.0 <= per_k["2"]["medusa_tokens_per_round"] <= 3.0
    assert "medusa_tokens_per_round" not in per_k["3"]
