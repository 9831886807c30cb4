"""RouteLLM's routing metrics (PGR, APGR, CPT, share at 95 % of cloud quality) on hand-checkable items."""

from __future__ import annotations

import numpy as np
import pytest

from shared.routing_eval import (
    Half,
    apgr,
    bootstrap_weights,
    cpt,
    evaluate_routers,
    pgr_curves,
    pgr_for_quality,
    routed_at,
    threshold_for_pgr,
)

# Ten items: the cloud is always right, the edge wrong on the last four (gap share g = 0.4).
EDGE = np.array([1, 1, 1, 1, 1, 1, 0, 0, 0, 0], dtype=bool)
CLOUD = np.ones(10, dtype=bool)
PERFECT = EDGE.astype(np.float64) + np.linspace(0.0, 0.01, 10)  # least confident exactly where the edge fails


def test_a_perfect_router_scores_one_minus_the_triangle() -> None:
    curves = pgr_curves(PERFECT, EDGE, CLOUD)
    assert curves.call_share[0, 0] == 0.0 and curves.pgr[0, 0] == 0.0
    assert curves.call_share[0, -1] == 1.0 and curves.pgr[0, -1] == pytest.approx(1.0)
    # PGR rises with slope 1 / 0.4 to 1 at a call share of 0.4, then stays: area 1 - 0.4 / 2.
    assert apgr(curves)[0] == pytest.approx(0.8)
    assert cpt(curves, 0.5)[0] == pytest.approx(0.2)
    assert cpt(curves, 0.8)[0] == pytest.approx(0.32)


def test_a_reversed_router_scores_the_triangle_alone() -> None:
    curves = pgr_curves(-PERFECT, EDGE, CLOUD)
    assert apgr(curves)[0] == pytest.approx(0.2)
    assert cpt(curves, 0.5)[0] == pytest.approx(0.8)


def test_a_constructed_curve_gives_its_known_area_and_cpts() -> None:
    # In order of rising confidence the cloud fixes the 1st and 3rd items: PGR 0, .5, .5, 1, 1 at shares 0..1.
    conf = np.array([1.0, 2.0, 3.0, 4.0])
    edge = np.array([0, 1, 0, 1], dtype=bool)
    cloud = np.ones(4, dtype=bool)
    curves = pgr_curves(conf, edge, cloud)
    assert curves.pgr[0].tolist() == pytest.approx([0.0, 0.5, 0.5, 1.0, 1.0])
    assert apgr(curves)[0] == pytest.approx(0.625)
    assert cpt(curves, 0.5)[0] == pytest.approx(0.25)
    assert cpt(curves, 0.8)[0] == pytest.approx(0.65)  # 0.3 of the way up the 0.5 -> 1 step between 0.5 and 0.75
    assert cpt(curves, 0.0)[0] == 0.0


def test_tied_confidences_move_together_and_a_constant_router_is_random() -> None:
    curves = pgr_curves(np.ones(10), EDGE, CLOUD)
    assert curves.call_share[0].tolist() == [0.0, 1.0]
    assert apgr(curves)[0] == pytest.approx(0.5)
    assert cpt(curves, 0.8)[0] == pytest.approx(0.8)


def test_random_routing_is_the_diagonal_in_expectation() -> None:
    rng = np.random.default_rng(3)
    n = 4000
    edge = rng.random(n) < 0.85
    cloud = edge | (rng.random(n) < 0.9)
    scores = np.array([apgr(pgr_curves(rng.random(n), edge, cloud))[0] for _ in range(20)])
    assert scores.mean() == pytest.approx(0.5, abs=0.02)


def test_pgr_exceeds_one_where_the_edge_beats_the_cloud_on_kept_items() -> None:
    edge = np.array([0, 0, 1, 1], dtype=bool)
    cloud = np.array([1, 1, 1, 0], dtype=bool)  # gap = 2/4 - ... q_c 0.75, q_e 0.5
    oracle = edge.astype(float) - cloud.astype(float)
    curves = pgr_curves(oracle, edge, cloud)
    assert curves.pgr[0].max() == pytest.approx(2.0)  # both fixes, keeping the edge's lone win
    assert curves.pgr[0, -1] == pytest.approx(1.0)


def test_no_gap_leaves_pgr_undefined() -> None:
    curves = pgr_curves(np.arange(4.0), np.ones(4, dtype=bool), np.array([1, 1, 1, 0], dtype=bool))
    assert np.isnan(apgr(curves)[0]) and np.isnan(cpt(curves, 0.5)[0])
    assert np.isnan(pgr_for_quality(0.9, 0.9))
    assert np.isnan(threshold_for_pgr(np.arange(4.0), np.ones(4, dtype=bool), np.ones(4, dtype=bool), 0.5))


def test_pgr_for_ninety_five_percent_of_cloud_quality() -> None:
    assert pgr_for_quality(0.5, 1.0) == pytest.approx(0.9)
    assert pgr_for_quality(0.96, 1.0) < 0  # the edge alone is within 5 % of the cloud
    curves = pgr_curves(PERFECT, EDGE, CLOUD)
    # 0.6 + PGR * 0.4 >= 0.95 needs PGR 0.875: 0.35 of the calls for the perfect router.
    assert cpt(curves, pgr_for_quality(0.6, 1.0))[0] == pytest.approx(0.35)


def test_threshold_chosen_on_one_half_applies_to_the_other() -> None:
    threshold = threshold_for_pgr(PERFECT, EDGE, CLOUD, 0.5)
    share, pgr, quality = routed_at(PERFECT, EDGE, CLOUD, threshold)
    assert share[0] == pytest.approx(0.2) and pgr[0] == pytest.approx(0.5) and quality[0] == pytest.approx(0.8)
    assert threshold_for_pgr(PERFECT, EDGE, CLOUD, 1.0) == PERFECT[0]  # the four failures go up, no more
    assert threshold_for_pgr(PERFECT, EDGE, CLOUD, 0.0) == float("-inf")
    # The same threshold on a second half with a different mix measures what it does there.
    other_edge = np.array([1, 1, 1, 1, 1, 1, 0, 0, 1, 1], dtype=bool)  # fails just where the first half did
    share, pgr, _ = routed_at(PERFECT, other_edge, CLOUD, threshold)
    assert share[0] == pytest.approx(0.2) and pgr[0] == pytest.approx(1.0)


def test_bootstrap_weights_resample_every_item_count() -> None:
    w = bootstrap_weights(50, 200, seed=1)
    assert w.shape == (200, 50) and (w.sum(axis=1) == 50).all()
    assert np.array_equal(w, bootstrap_weights(50, 200, seed=1))
    assert not np.array_equal(w, bootstrap_weights(50, 200, seed=2))


def test_evaluate_routers_orders_oracle_signal_and_random_with_intervals() -> None:
    rng = np.random.default_rng(0)
    n = 600
    edge = rng.random(n) < 0.8
    cloud = edge | (rng.random(n) < 0.9)
    useful = edge + rng.normal(0, 0.6, n)  # noisy but informative
    half = n // 2
    val = Half({"useful": useful[:half]}, edge[:half], cloud[:half])
    test = Half({"useful": useful[half:]}, edge[half:], cloud[half:])
    report = evaluate_routers(val, test, resamples=300, seed=5)
    assert report == evaluate_routers(val, test, resamples=300, seed=5), "seeded"
    routers, oracle = report["routers"], report["oracle"]
    assert set(routers) == {"useful", "random_sample"}
    assert report["random_expected"]["apgr"] == 0.5
    assert report["random_expected"]["cpt_80"]["call_share"] == 0.8
    assert oracle["apgr"] >= routers["useful"]["apgr"] > routers["random_sample"]["apgr"]
    assert abs(routers["random_sample"]["apgr"] - 0.5) < 0.15
    for r in (*routers.values(), oracle):
        lo, hi = r["apgr_ci95"]
        assert lo <= r["apgr"] <= hi
    useful_report = routers["useful"]
    assert useful_report["cpt_80"]["test_curve"] < 0.8 < routers["random_sample"]["cpt_80"]["test_curve"] + 0.2
    assert 0.0 <= useful_report["cpt_80"]["call_share"] <= 1.0 and useful_report["cpt_80"]["pgr"] > 0.5
    lo, hi = report["gap_ci95"]
    assert 0 < lo <= report["gap"] <= hi and report["resamples_without_gap"] == 0
    entry = useful_report["share_at_95pct_quality"]
    assert entry["quality_ratio"] >= 0.9 and 0.0 <= entry["call_share"] <= 1.0
    assert len(useful_report["pgr_at_call_share"]) == 21


def _gain_report(seed: int) -> dict:
    """Graded items with a real gap, an informative router and one that is random, evaluated like the bench."""
    rng = np.random.default_rng(seed)
    n = 800
    edge = rng.integers(0, 9, n) / 8  # graded 0..1, as lm-micro-next8's quality
    cloud = np.clip(edge + rng.choice([0.0, 0.125, 0.5], n, p=[0.5, 0.3, 0.2]), 0.0, 1.0)
    signals = {"informative": edge - cloud + rng.normal(0, 0.2, n), "coin": rng.random(n)}
    half = n // 2
    val = Half({k: v[:half] for k, v in signals.items()}, edge[:half], cloud[:half])
    test = Half({k: v[half:] for k, v in signals.items()}, edge[half:], cloud[half:])
    return evaluate_routers(val, test, resamples=400, seed=seed)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_apgr_gain_vs_random_states_the_margin_over_random_with_a_paired_interval(seed: int) -> None:
    report = _gain_report(seed)
    routers, oracle = report["routers"], report["oracle"]
    for r in (*routers.values(), oracle):
        lo, hi = r["apgr_gain_vs_random_ci95"]
        assert lo <= r["apgr_gain_vs_random"] <= hi
        # Random routing's expectation is the constant 0.5: the gain is APGR shifted, interval included.
        assert r["apgr_gain_vs_random"] == pytest.approx(r["apgr"] - 0.5, abs=1e-4)
        assert [lo, hi] == pytest.approx([b - 0.5 for b in r["apgr_ci95"]], abs=2e-4)
    # A router that routes at random gains nothing over random: its interval holds zero.
    coin = routers["coin"]
    assert abs(coin["apgr_gain_vs_random"]) < 0.1 and not coin["apgr_gain_vs_random_excludes_zero"]
    lo, hi = coin["apgr_gain_vs_random_ci95"]
    assert lo < 0 < hi
    # The oracle and an informative router are above random with intervals that exclude zero.
    for r in (oracle, routers["informative"]):
        assert r["apgr_gain_vs_random"] > 0.1 and r["apgr_gain_vs_random_excludes_zero"]
        assert r["apgr_gain_vs_random_ci95"][0] > 0
    assert oracle["apgr_gain_vs_random"] >= routers["informative"]["apgr_gain_vs_random"]


def test_apgr_gain_vs_the_seeded_random_router_is_paired() -> None:
    """Against the seeded random router on the same resamples: pairing removes the items' shared noise, so the
    interval of the difference is no wider than the two intervals' widths added."""
    report = _gain_report(3)
    routers = report["routers"]
    sample = routers["random_sample"]
    assert "apgr_gain_vs_random_sample" not in sample
    r = routers["informative"]
    assert r["apgr_gain_vs_random_sample"] == pytest.approx(r["apgr"] - sample["apgr"], abs=2e-4)
    lo, hi = r["apgr_gain_vs_random_sample_ci95"]
    assert lo <= r["apgr_gain_vs_random_sample"] <= hi and lo > 0
    width = (r["apgr_ci95"][1] - r["apgr_ci95"][0]) + (sample["apgr_ci95"][1] - sample["apgr_ci95"][0])
    assert hi - lo <= width
    coin = routers["coin"]
    lo, hi = coin["apgr_gain_vs_random_sample_ci95"]
    assert lo < 0 < hi
