"""The gain-aligned routers of ``bench cascade``: the L2 strength chosen by cross-validation within validation
(``fit_router_cv``), and ``router_gain_probe``, the gain router stacked on a hidden-state probe fitted on what
escalating gains. Where the edge's hidden state says where the cloud gains and no shipped signal does, the stacked
router ranks escalations better on held-out items, and the policy it ships (signal ``router`` with the probe)
decides on a device's inputs exactly as the bench measured."""

from __future__ import annotations

import json

import numpy as np

from bench.cascade_bench import MIN_GAIN_PROBE_ITEMS, evaluate
from bench.cascade_tasks import TaskResults
from shared.escalation import (
    HIDDEN_PROBE,
    L2_GRID,
    ROUTER,
    ROUTER_GAIN,
    ROUTER_GAIN_PROBE,
    EdgePolicy,
    fit_router,
    fit_router_cv,
    no_loss_target,
)
from shared.routing_eval import apgr, pgr_curves

V, D = 24, 6  # vocabulary and hidden width of a made-up tied-embedding LM


def _task(n: int, seed: int = 0) -> TaskResults:
    """Graded items whose gain (cloud - edge) follows the hidden state's first coordinate; the one signal sees the
    edge's own quality only (both tiers do well on the same easy items), as on the micro LM pair."""
    rng = np.random.default_rng(seed)
    embedding = rng.normal(size=(V, D))
    hidden = rng.normal(size=(n, D))
    easy = rng.random(n)
    edge = np.clip(np.round(8 * (0.6 * easy + 0.1 * rng.random(n))) / 8, 0, 1)
    cloud = np.clip(edge + np.round(8 * np.clip(0.25 + 0.2 * hidden[:, 0], 0, 1) * rng.random(n)) / 8, 0, 1)
    confidence = easy + rng.normal(0, 0.05, n)
    return TaskResults(
        task="lm-micro-next8",
        edge_model="tierline/lm-micro",
        cloud_model="tierline/lm-cloud",
        signals={"mean_logprob": np.log(0.05 + confidence.clip(0, 1)), "copy_kept": rng.random(n)},
        prompt_tokens=rng.integers(16, 248, n).astype(np.float64),
        edge_good=edge,
        cloud_good=cloud,
        agrees=np.minimum(edge, cloud),
        signal_s=np.full(n, 1e-4),
        probe_input="mean_logits",
        probe_inputs=hidden @ embedding.T,  # what the runtime averages: the logits of the hidden state
        probe_projection=np.linalg.pinv(embedding),
        probe_s=np.zeros(n),
    )


def _apgr(conf: np.ndarray, edge: np.ndarray, cloud: np.ndarray) -> float:
    return float(apgr(pgr_curves(conf, edge, cloud))[0])


def test_the_stacked_gain_router_ranks_what_escalation_gains_and_ships_as_measured() -> None:
    results = _task(800)
    report = evaluate(results, seed=0, resamples=200).report
    routers = report["routing"]["routers"]
    assert {ROUTER_GAIN, ROUTER_GAIN_PROBE} <= set(report["signals"])
    assert set(report["router_l2"]) == {ROUTER_GAIN, ROUTER_GAIN_PROBE, "gain_probe"}
    assert all(v in L2_GRID for v in report["router_l2"].values())
    stacked, plain = routers[ROUTER_GAIN_PROBE], routers[ROUTER_GAIN]
    # The probe reads what the signals miss: clearly above the signal-only gain router and random routing.
    assert stacked["apgr"] > plain["apgr"] + 0.05
    assert stacked["apgr_gain_vs_random_ci95"][0] > 0
    assert report["decision_p95_ms_by_signal"][ROUTER_GAIN_PROBE] > 0


def test_the_stacked_router_policy_decides_on_device_inputs_as_the_bench() -> None:
    """Rebuild what the bench ships (the gain probe on the mean logits, the router reading its confidence as
    feature ``hidden_probe``) and check the policy, after a JSON round trip, scores every item as the bench's
    router does from the same inputs."""
    from bench.cascade_bench import _features, fit_gain_probe

    results = _task(400, seed=1)
    rows = np.arange(200)
    gain = fit_gain_probe(results, rows)
    assert gain is not None and len(gain.validation) == len(rows)
    # Out of fold: the validation confidences are not the final probe's in-sample ones.
    assert results.probe_inputs is not None
    assert not np.allclose(gain.validation, gain.probe.confidences(results.probe_inputs[rows]))
    features = _features(results, rows) | {HIDDEN_PROBE: gain.validation}
    target = no_loss_target(results.edge_good[rows], results.cloud_good[rows])
    router, _ = fit_router_cv(features, target, list(features), results.edge_good[rows], results.cloud_good[rows])
    policy = EdgePolicy("tierline/lm-micro", ROUTER, 0.5, router=router, probe=gain.probe)
    shipped = EdgePolicy.from_json(json.loads(json.dumps(policy.to_json())))
    test = np.arange(200, 400)
    table = _features(results, test) | {HIDDEN_PROBE: gain.probe.confidences(results.probe_inputs[test])}
    bench_conf = router.confidences(table)
    assert results.prompt_tokens is not None
    for j, i in enumerate(test):
        values = {k: float(v[i]) for k, v in results.signals.items()} | {
            "prompt_tokens": float(results.prompt_tokens[i])
        }
        values |= shipped.probe_signal(results.probe_inputs[i])  # what the agent adds for a probe-reading router
        assert abs(shipped.confidence(values) - bench_conf[j]) < 1e-9


def test_too_few_validation_items_fit_no_stacked_router() -> None:
    results = _task(2 * MIN_GAIN_PROBE_ITEMS - 2)
    report = evaluate(results, seed=0, resamples=100).report
    assert ROUTER_GAIN_PROBE not in report["signals"] and ROUTER_GAIN in report["signals"]


def test_cross_validated_l2_is_chosen_on_the_given_items_only_and_generalises() -> None:
    """Many noise features and one that matters: the strength chosen within the fitting half routes the other half
    about as well as the best strength of the grid would have (which only the other half could tell)."""
    rng = np.random.default_rng(4)
    n, k = 300, 40
    x = rng.normal(size=(n, k))
    edge = (rng.random(n) < 0.3).astype(float)
    cloud = np.maximum(edge, (x[:, 0] + rng.normal(0, 0.7, n) > 0).astype(float))
    table = {f"f{j}": x[:, j] for j in range(k)}
    fit, held = np.arange(n // 2), np.arange(n // 2, n)
    part = {f: v[fit] for f, v in table.items()}
    target = no_loss_target(edge[fit], cloud[fit])
    router, l2 = fit_router_cv(part, target, list(table), edge[fit], cloud[fit])
    assert l2 in L2_GRID
    again, l2_again = fit_router_cv(part, target, list(table), edge[fit], cloud[fit])
    assert l2_again == l2 and again.weights == router.weights  # seeded folds
    held_table = {f: v[held] for f, v in table.items()}
    by_l2 = {
        g: _apgr(fit_router(part, target, list(table), l2=g).confidences(held_table), edge[held], cloud[held])
        for g in L2_GRID
    }
    chosen = _apgr(router.confidences(held_table), edge[held], cloud[held])
    assert chosen >= max(by_l2.values()) - 0.05 and chosen > 0.6
    _, l2_few = fit_router_cv({f: v[:10] for f, v in part.items()}, target[:10], list(table), edge[:10], cloud[:10])
    assert l2_few == L2_GRID[0]  # too few items to cross-validate: the grid's first strength


def test_the_edge_evidence_is_the_per_answer_signals_and_mean_logits_of_the_rows() -> None:
    """``_EdgeRun.add`` (what ``signal_s``/``probe_s`` time) stacks the rows once for both the signals and the
    probe input: the values are exactly those computed from the rows as the device hands them over."""
    from bench.cascade_tasks import _EdgeRun
    from shared.escalation import copy_signals, lm_signals, step_signals

    rng = np.random.default_rng(2)
    run = _EdgeRun(with_copy=True)
    cases = []
    for _ in range(20):
        prompt = rng.integers(0, 50, size=int(rng.integers(3, 248))).tolist()
        steps = int(rng.integers(1, 9))
        rows = [rng.normal(0, 4, size=V).astype(np.float32) for _ in range(steps)]
        out = [int(r.argmax()) for r in rows]
        run.add(prompt, out, rows)
        cases.append((prompt, out, rows))
    for k, (prompt, out, rows) in enumerate(cases):
        signals = lm_signals(step_signals(np.array(rows), out)) | copy_signals(prompt, out)
        assert run.signals[k] == signals
        assert np.array_equal(run.mean_logits[k], np.mean(rows, axis=0, dtype=np.float64))
    assert len(run.signal_s) == len(run.probe_s) == len(cases) and min(run.signal_s) > 0
