"""The learned router clips each feature to the range it was fitted on: a request unlike every calibration item
(issue 40: a 3-token prompt against calibration prompts of ~125 tokens, z = -9.7) cannot drive the confidence to
an extreme; a router stored before the range was kept loads and behaves as it did."""

from __future__ import annotations

import json

import numpy as np

from shared.escalation import EdgePolicy, LearnedRouter, fit_router


def _fitted() -> LearnedRouter:
    rng = np.random.default_rng(0)
    tokens = rng.uniform(100, 150, 400)
    margin = rng.uniform(0, 1, 400)
    good = (margin + (tokens - 125) / 50 + rng.normal(0, 0.3, 400)) > 0.5
    return fit_router({"prompt_tokens": tokens, "min_margin": margin}, good, ["prompt_tokens", "min_margin"])


def test_a_feature_outside_the_calibration_range_weighs_as_its_nearest_end() -> None:
    router = _fitted()
    assert router.low is not None and router.high is not None
    assert 100 <= router.low[0] < 101 and 149 < router.high[0] <= 150
    at_min = router.confidence({"prompt_tokens": router.low[0], "min_margin": 0.5})
    for tokens in (3.0, 30.0, -1e6):
        assert router.confidence({"prompt_tokens": tokens, "min_margin": 0.5}) == at_min
    at_max = router.confidence({"prompt_tokens": router.high[0], "min_margin": 0.5})
    assert router.confidence({"prompt_tokens": 10_000.0, "min_margin": 0.5}) == at_max
    # Inside the range nothing changes; the batch path clips alike.
    inside = {"prompt_tokens": 120.0, "min_margin": 0.3}
    unclipped = LearnedRouter(router.features, router.weights, router.bias, router.mean, router.std)
    assert router.confidence(inside) == unclipped.confidence(inside)
    table = {"prompt_tokens": np.array([3.0, 120.0, 1e4]), "min_margin": np.array([0.5, 0.3, 0.5])}
    assert np.allclose(router.confidences(table), [at_min, router.confidence(inside), at_max])


def test_an_unclipped_router_would_have_been_driven_to_an_extreme() -> None:
    router = _fitted()
    unclipped = LearnedRouter(router.features, router.weights, router.bias, router.mean, router.std)
    far = {"prompt_tokens": 3.0, "min_margin": 0.5}
    assert unclipped.confidence(far) < 1e-4  # z far below anything calibrated: "certainly wrong"
    assert router.confidence(far) > 100 * unclipped.confidence(far)  # clipped: the least the calibration saw


def test_a_policy_stored_before_the_range_loads_and_is_not_clipped() -> None:
    router = _fitted()
    policy = EdgePolicy("tierline/lm-edge", signal="router", threshold=0.5, router=router)
    stored = json.loads(json.dumps(policy.to_json()))
    assert EdgePolicy.from_json(stored).router == router  # the range travels with the policy
    del stored["router"]["low"], stored["router"]["high"]
    old = EdgePolicy.from_json(stored)
    assert old.router is not None and old.router.low is None and old.router.high is None
    far = {"prompt_tokens": 3.0, "min_margin": 0.5}
    expected = LearnedRouter(router.features, router.weights, router.bias, router.mean, router.std).confidence(far)
    assert old.router.confidence(far) == expected
