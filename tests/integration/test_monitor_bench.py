"""``tierline bench monitor`` on the tiny zoo: the monitor's rule tells the mis-set policy from the calibrated one."""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.integration


def test_the_mis_set_policy_alerts_and_the_calibrated_one_mostly_does_not(tiny_zoo: Path) -> None:
    from bench.monitor_bench import run_monitor_bench

    report = run_monitor_bench(tiny_zoo, trials=100)
    policies = report["policies"]
    assert report["horizon_samples"] == 200 and report["n_test"] > 100
    mis_set, calibrated = policies["mis_set_loss_0.01"], policies["calibrated_loss_0.01"]
    assert mis_set["test_edge_share"] == 1.0 and mis_set["test_agreement"] < mis_set["promised_agreement"]
    assert mis_set["alert_rate_within_horizon"] >= 0.9 and mis_set["samples_to_alert_p95"] <= 200
    assert calibrated["alert_rate_within_horizon"] <= 0.1
