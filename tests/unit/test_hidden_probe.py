"""The hidden-state probe: trained on hidden states, shipped folded onto what the runtime produces (the logits of
a tied-embedding LM), carried in the edge policy JSON without breaking policies that have none."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from shared.calibration import calibrate, read_validation, validation_row
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


def _rows(tmp_path: Path, n: int = 120) -> Path:
    """Validation rows where the probe input says which edge answers are right and the signal is noise."""
    rng = np.random.default_rng(3)
    path = tmp_path / "val.jsonl"
    lines = []
    for _ in range(n):
        pixels = rng.random(4)
        good = bool(pixels[0] > 0.4)
        row = validation_row(
            "tierline/digits-micro",
            {"softmax_margin": float(rng.random())},
            None,
            edge_good=good,
            cloud_good=True,
            agrees_with_cloud=good,
            probe=("pixels", pixels),
        )
        lines.append(json.dumps(row))
    path.write_text("\n".join(lines) + "\n")
    return path


def test_calibration_keeps_the_probe_when_it_wins_on_validation(tmp_path: Path) -> None:
    data = read_validation(_rows(tmp_path), "digits-micro")
    assert data.probe_inputs is not None and data.probe_inputs.shape == (120, 4) and data.probe_input == "pixels"
    policy, ranking = calibrate(data, 0.01)
    assert policy.signal == HIDDEN_PROBE and policy.probe is not None
    assert {c.signal for c in ranking} == {"softmax_margin", HIDDEN_PROBE, "router", "router_gain"}
    shipped = EdgePolicy.from_json(json.loads(json.dumps(policy.to_json())))
    local = [not shipped.should_escalate(shipped.probe_signal(x)) for x in data.probe_inputs]
    quality = np.where(local, data.edge_good, data.cloud_good).mean()
    assert quality >= 0.99 - 1e-9 and np.mean(local) > 0.4  # most right answers stay local, within the bound


def test_a_malformed_probe_row_is_refused_naming_the_field(tmp_path: Path) -> None:
    path = _rows(tmp_path, 12)
    lines = path.read_text().splitlines()
    row = json.loads(lines[3])
    row["probe"] = {"input": "pixels", "values": ["x"]}
    lines[3] = json.dumps(row)
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ConfigurationError, match=r"val.jsonl:4: 'probe'"):
        read_validation(path, "digits-micro")


def test_the_agent_scores_tensor_rows_with_the_policy_probe() -> None:
    from edge_agent.tensors import row_confidences

    rows = np.array([[3.0, 0.0], [0.0, 3.0]])
    signals = {"softmax_margin": np.array([0.9, 0.9])}
    probe = LinearProbe("pixels", [1.0, -1.0], 0.0, hidden_size=2)
    conf, threshold = row_confidences(EdgePolicy("m", HIDDEN_PROBE, 0.5, probe=probe), signals, rows, 0.3)
    assert threshold == 0.5 and conf[0] > 0.9 and conf[1] < 0.1  # the second row escalates, the margin says no
    conf, threshold = row_confidences(EdgePolicy("m", "softmax_margin", 0.7), signals, rows, 0.3)
    assert threshold == 0.7 and list(conf) == [0.9, 0.9]
    conf, threshold = row_confidences(EdgePolicy("m", "mean_logprob", -1.0), signals, rows, 0.3)
    assert threshold == 0.3 and list(conf) == [0.9, 0.9]  # an LM signal on a classifier: the default margin
