"""The one generator of demo LM requests (``tierline.demo_traffic.lm_items``): what ``demo traffic`` sends and
what the demo policy is calibrated on (``policy_items``, the ``lm-traffic`` cascade task)."""

from __future__ import annotations

import random

import pytest

from shared.zoo.corpus import held_out_files
from tierline.demo_traffic import DEFAULT_MIX, lm_items, parse_mix, policy_items, policy_shares

MODEL = "tierline/lm-edge-onnx-int8"


def test_each_request_carries_what_the_file_holds_after_its_prompt() -> None:
    texts = [f.text for f in held_out_files()]
    easy, hard = lm_items(MODEL, random.Random(3), 30)
    assert len(easy) == len(hard) == 30
    for item in easy:
        assert item.body["stop"] == ["\n"] and item.body["max_tokens"] == 16
        assert item.reference and "\n" not in item.reference
        # the prompt ends half-way through a line whose rest is the reference
        assert any(item.body["prompt"] + item.reference + "\n" in t for t in texts)
    for item in hard:
        assert "stop" not in item.body and item.body["max_tokens"] == 48
        assert item.reference is not None and any(item.body["prompt"] + item.reference in t for t in texts)
    assert sum(item.body.get("quality") == "high" for item in hard) == 10  # one in three


def test_the_calibration_items_are_the_requests_the_policy_decides_in_the_mix_shares() -> None:
    shares = policy_shares(parse_mix(DEFAULT_MIX))
    assert shares == {
        "easy": pytest.approx(0.6 / (0.6 + 0.25 * 2 / 3), abs=1e-4),
        "hard": pytest.approx(0.2174, abs=1e-4),
    }
    items = policy_items(MODEL, random.Random(0), 100)
    assert len(items) == 100
    kinds = [item.kind for item in items]
    assert kinds.count("easy") == round(100 * shares["easy"]) and kinds.count("hard") == 100 - kinds.count("easy")
    assert not any(item.body.get("quality") == "high" for item in items)  # the request sends those up, not the policy
    assert [i.body for i in policy_items(MODEL, random.Random(0), 100)] == [i.body for i in items]  # seeded
    assert [i.kind for i in policy_items(MODEL, random.Random(0), 20, mix={"easy": 1.0})] == ["easy"] * 20
    assert policy_shares({"digits": 1.0}) == {}
