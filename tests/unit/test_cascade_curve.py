"""The quality-vs-edge-share arithmetic the cascade benchmark and ``tierline edge calibrate`` share."""

from __future__ import annotations

import numpy as np
import pytest

from shared.escalation import auc_gain_vs_random, quality_curve, rank_signals, routed_quality

# Ten requests: the edge gets the first six right, the cloud the first nine.
EDGE_GOOD = np.array([1, 1, 1, 1, 1, 1, 0, 0, 0, 0], dtype=bool)
CLOUD_GOOD = np.array([1, 1, 1, 1, 1, 1, 1, 1, 1, 0], dtype=bool)
PERFECT = np.arange(10, 0, -1, dtype=np.float64)  # most confident exactly where the edge is right


def test_curve_runs_from_cloud_only_to_edge_only() -> None:
    shares, quality = quality_curve(PERFECT, EDGE_GOOD, CLOUD_GOOD)
    assert (shares[0], quality[0]) == (0.0, pytest.approx(0.9))
    assert (shares[-1], quality[-1]) == (1.0, pytest.approx(0.6))
    assert quality[shares == 0.6][0] == pytest.approx(0.9), "the six right edge answers cost nothing"


def test_tied_confidences_move_together() -> None:
    shares, _ = quality_curve(np.ones(10), EDGE_GOOD, CLOUD_GOOD)
    assert shares.tolist() == [0.0, 1.0]
    assert auc_gain_vs_random(np.ones(10), EDGE_GOOD, CLOUD_GOOD) == pytest.approx(0.0)


def test_auc_gain_is_positive_for_a_useful_signal_and_negative_for_a_reversed_one() -> None:
    assert auc_gain_vs_random(PERFECT, EDGE_GOOD, CLOUD_GOOD) == pytest.approx(0.075)
    assert auc_gain_vs_random(-PERFECT, EDGE_GOOD, CLOUD_GOOD) < -0.05


def test_routed_quality_answers_at_or_above_the_threshold_locally() -> None:
    assert routed_quality(PERFECT, EDGE_GOOD, CLOUD_GOOD, 5.0) == (pytest.approx(0.6), pytest.approx(0.9))
    assert routed_quality(PERFECT, EDGE_GOOD, CLOUD_GOOD, float("inf")) == (0.0, pytest.approx(0.9))


def test_rank_signals_puts_the_signal_answering_most_locally_within_the_bound_first() -> None:
    ranking = rank_signals({"reversed": -PERFECT, "perfect": PERFECT}, EDGE_GOOD, CLOUD_GOOD, 0.0)
    assert [c.signal for c in ranking] == ["perfect", "reversed"]
    assert ranking[0].edge_share == pytest.approx(0.6) and ranking[0].quality == pytest.approx(0.9)
