"""The hidden-state probe: trained on hidden states, shipped folded onto what the runtime produces (the logits of
a tied-embedding LM), carried in the edge policy JSON without breaking policies that have none."""

from __future__ import annotations

import json

import numpy as np
import pytest

from shared.errors import ConfigurationError
from shared.escalation import (
    HIDDEN_PROBE,
    EdgePolicy,
    LinearProbe,
    fit_router,
    fold_hidden_probe,
    hidden_from_logits,
)


def _tied_lm(
    rng: np.random.Generator, n: int = 400, d: int = 16, v: int = 96
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Hidden states and the logits a tied-embedding head makes of them."""
    embedding = rng.normal(size=(v, d))
    hidden = rng.normal(size=(n, d))
    return hidden, hidden @ embedding.T, embedding


def test_probe_folded_onto_logits_matches_the_probe_on_hidden_states() -> None:
    rng = np.random.default_rng(0)
    hidden, logits, embedding = _tied_lm(rng)
    target = (hidden[:, 0] + 0.5 * hidden[:, 1] > 0).astype(np.float64)
    table = {f"h{j}": hidden[:, j] for j in range(hidden.shape[1])}
    router = fit_router(table, target, list(table), l2=1e-3)
    probe = fold_hidden_probe(router, hidden_from_logits(embedding), "mean_logits", hidden.shape[1])

    assert len(probe.weights) == logits.shape[1] and probe.hidden_size == hidden.shape[1]
    np.testing.assert_allclose(probe.confidences(logits), router.confidences(table), atol=1e-9)
    # It learned the hidden direction: the probe ranks the positives above the negatives.
    conf = probe.confidences(logits)
    assert conf[target == 1].mean() > conf[target == 0].mean() + 0.3


def test_policy_with_a_probe_round_trips_and_escalates_on_it() -> None:
    probe = LinearProbe("pixels", [1.0, -1.0], 0.0, hidden_size=2)
    policy = EdgePolicy("tierline/digits-micro", HIDDEN_PROBE, 0.5, probe=probe)
    again = EdgePolicy.from_json(json.loads(json.dumps(policy.to_json())))
    assert again.probe == probe and again.signal == HIDDEN_PROBE

    confident = {"max_prob": 0.9} | again.probe_signal(np.array([3.0, 0.0]))
    doubtful = {"max_prob": 0.9} | again.probe_signal(np.array([0.0, 3.0]))
    assert not again.should_escalate(confident)
    assert again.should_escalate(doubtful)


def test_old_policies_stay_valid_and_a_probe_signal_needs_weights() -> None:
    old = {"schema": "tierline.edge-policy/v1", "model": "tierline/lm-edge", "signal": "mean_logprob", "threshold": -2}
    policy = EdgePolicy.from_json(old)
    assert policy.probe is None and policy.probe_signal(np.zeros(3)) == {}
    with pytest.raises(ConfigurationError, match="hidden_probe"):
        EdgePolicy("tierline/lm-edge", HIDDEN_PROBE, 0.5)
    with pytest.raises(ConfigurationError, match="probe input"):
        LinearProbe("attention", [1.0], 0.0)
    with pytest.raises(ConfigurationError, match="takes 2 inputs"):
        LinearProbe("pixels", [1.0, 2.0], 0.0).confidence(np.zeros(3))
