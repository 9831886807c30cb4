"""``tierline edge calibrate`` over an existing policy: the operator's settings stay, everything calibration decides
(signal, threshold, router, hidden-state probe, calibration record) is the new calibration's."""

from __future__ import annotations

import numpy as np

from edge_agent.calibrate import _merge
from shared.escalation import HIDDEN_PROBE, EdgePolicy, LinearProbe


def _probe(weight: float) -> LinearProbe:
    return LinearProbe(input="pixels", weights=[weight, 0.0], bias=0.0, hidden_size=2)


def test_recalibrating_a_probe_policy_ships_the_new_probe_and_keeps_operator_settings() -> None:
    existing = EdgePolicy(
        "tierline/digits-small", signal=HIDDEN_PROBE, threshold=0.5, probe=_probe(1.0), mode="cloud-first"
    )
    calibrated = EdgePolicy(
        "tierline/digits-small", signal=HIDDEN_PROBE, threshold=0.7, probe=_probe(-3.0), calibration={"n": 1}
    )
    merged = _merge(existing, calibrated)
    assert merged.probe == calibrated.probe and merged.threshold == 0.7
    assert merged.mode == "cloud-first"
    # The confidence the agent computes is the new probe's, not the old one's.
    assert merged.probe_signal(np.array([1.0, 0.0]))[HIDDEN_PROBE] < 0.5


def test_probe_policy_replacing_a_signal_policy_carries_its_probe() -> None:
    existing = EdgePolicy("tierline/digits-small", signal="max_prob", threshold=0.9, max_new_tokens=64)
    calibrated = EdgePolicy("tierline/digits-small", signal=HIDDEN_PROBE, threshold=0.6, probe=_probe(2.0))
    merged = _merge(existing, calibrated)
    assert merged.signal == HIDDEN_PROBE and merged.probe == calibrated.probe and merged.max_new_tokens == 64


def test_signal_policy_replacing_a_probe_policy_drops_the_stale_probe() -> None:
    existing = EdgePolicy("tierline/digits-small", signal=HIDDEN_PROBE, threshold=0.5, probe=_probe(1.0))
    calibrated = EdgePolicy("tierline/digits-small", signal="max_prob", threshold=0.9)
    assert _merge(existing, calibrated).probe is None
