"""How fast the live quality monitor notices a mis-set policy, and how often it cries wolf on a correct one.

The digits pair with a real gap (``digits-micro`` at the edge, ``digits-large`` in the cloud), both run on every
held-out digit. The items are split as ``bench cascade`` splits them (seed 0): the policy is calibrated on the
validation half; shadow traffic is drawn, with replacement, from the test half, in batches of ``batch`` samples,
and the monitor's rule (``controlplane.policies.monitor.is_below_promise``) is checked after each batch, as the
cloud does. Per policy: the share of streams that alert within ``horizon`` samples, and the samples until the alert.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np

from controlplane.policies.monitor import calibrated_agreement, is_below_promise
from shared.calibration import ValidationSet, calibrate
from shared.escalation import ROUTER, EdgePolicy


def _confidence(policy: EdgePolicy, signals: dict[str, np.ndarray]) -> np.ndarray:
    if policy.signal == ROUTER and policy.router is not None:
        return policy.router.confidences(signals)
    return signals[policy.signal]


def _first_alert(agrees: np.ndarray, promised: float, rng: np.random.Generator, horizon: int, batch: int) -> int | None:
    stream = agrees[rng.integers(0, len(agrees), horizon)]
    counts = np.cumsum(stream)
    for n in range(batch, horizon + 1, batch):
        if is_below_promise(int(counts[n - 1]), n, promised):
            return n
    return None


def run_monitor_bench(
    zoo_root: Path, *, trials: int = 1000, horizon: int = 200, batch: int = 20, seed: int = 0
) -> dict[str, Any]:
    from bench.cascade_tasks import run_digits
    from shared.zoo.registry import ZooLayout

    results = run_digits(ZooLayout(zoo_root), "digits-micro")
    n = len(results)
    order = np.random.default_rng(0).permutation(n)
    val, test = np.sort(order[: n // 2]), np.sort(order[n // 2 :])
    data = ValidationSet(
        model=results.edge_model,
        signals={k: v[val] for k, v in results.signals.items()},
        prompt_tokens=None,
        edge_good=results.edge_good[val],
        cloud_good=results.cloud_good[val],
        agrees=results.agrees[val],
    )
    test_signals = {k: v[test] for k, v in results.signals.items()}
    rng = np.random.default_rng(seed)
    policies: dict[str, Any] = {}
    for loss in (0.01, 0.02, 0.05):
        policy, _ = calibrate(data, loss)
        share = float(policy.calibration["edge_share"])
        promised = calibrated_agreement(_confidence(policy, data.signals), data.agrees, share)
        assert promised is not None
        variants = {
            f"calibrated_loss_{loss:g}": policy,
            f"mis_set_loss_{loss:g}": dataclasses.replace(policy, threshold=0.0),
        }
        for name, variant in variants.items():
            kept = _confidence(variant, test_signals) >= variant.threshold
            agrees = results.agrees[test][kept]
            alerts = [_first_alert(agrees, promised, rng, horizon, batch) for _ in range(trials)]
            at = np.array([a for a in alerts if a is not None])
            policies[name] = {
                "signal": variant.signal,
                "threshold": round(variant.threshold, 4),
                "promised_agreement": round(promised, 4),
                "test_edge_share": round(float(kept.mean()), 4),
                "test_agreement": round(float(agrees.mean()), 4),
                "alert_rate_within_horizon": round(len(at) / trials, 4),
                "samples_to_alert_median": int(np.median(at)) if len(at) else None,
                "samples_to_alert_p95": int(np.percentile(at, 95)) if len(at) else None,
            }
    return {
        "pair": f"{results.edge_model} vs {results.cloud_model}",
        "n_validation": len(val),
        "n_test": len(test),
        "trials": trials,
        "horizon_samples": horizon,
        "batch_samples": batch,
        "policies": policies,
    }
