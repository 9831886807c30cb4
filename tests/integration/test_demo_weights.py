"""The committed demo weights: pinned hashes hold and transformers loads them."""

from __future__ import annotations

import json

import pytest

from shared.zoo.build import check_pinned_hashes, committed_weights
from shared.zoo.presets import DEMO

pytestmark = pytest.mark.integration

WEIGHTS = committed_weights(DEMO)


def test_demo_weights_match_their_pinned_hashes() -> None:
    check_pinned_hashes(WEIGHTS)


def test_demo_weights_load_in_transformers_and_cloud_beats_edge() -> None:
    import torch
    from transformers import AutoModelForCausalLM

    report = json.loads((WEIGHTS / "training.json").read_text())
    assert report["cloud"]["held_out_loss"] < report["edge"]["held_out_loss"]
    for role in ("edge", "cloud"):
        model = AutoModelForCausalLM.from_pretrained(WEIGHTS / f"lm-{role}", dtype=torch.float32)
        assert model.config.model_type == "llama"
    total = sum(p.stat().st_size for p in WEIGHTS.rglob("*") if p.is_file())
    assert total < 40 * 1024 * 1024
