"""The demo policy is calibrated on the traffic it is promised for (issue 40): the ``lm-traffic`` task runs the
``demo traffic`` generator's requests through the agent's own code on the tiny zoo, a policy is calibrated on one
part of them (through the ``--export-validation`` format, graded rows and kinds included), and on fresh requests of
the same generator it keeps about the share on the edge it promised (``controlplane.policies.live.tolerance``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from bench.cascade_bench import export_validation
from bench.cascade_tasks import run_lm_traffic
from controlplane.policies.live import tolerance
from shared.calibration import ValidationSet, calibrate, read_validation, router_inputs
from shared.escalation import ROUTER, EdgePolicy
from shared.zoo.registry import ZooLayout

ITEMS = 80  # half calibrate the policy, half are the fresh traffic it is checked on


def _confidence(policy: EdgePolicy, data: ValidationSet) -> np.ndarray:
    if policy.signal == ROUTER:
        assert policy.router is not None
        return policy.router.confidences(router_inputs(data))
    return np.asarray(data.signals[policy.signal])


def test_a_policy_calibrated_on_the_traffic_keeps_its_edge_share_on_fresh_traffic(
    tiny_zoo: Path, tmp_path: Path
) -> None:
    results = run_lm_traffic(ZooLayout(tiny_zoo), ITEMS, seed=0)
    assert results.task == "lm-traffic" and len(results) == ITEMS
    assert results.kinds is not None and set(results.kinds) == {"easy", "hard"}
    easy = np.array(results.kinds) == "easy"
    assert set(np.unique(results.edge_good[easy])) <= {0.0, 1.0}  # easy: the rest of the line, exactly
    assert ((results.edge_good >= 0) & (results.edge_good <= 1)).all()  # hard: graded
    assert "prompt_tokens" not in results.signals and {"copy_kept", "min_margin"} <= set(results.signals)
    half = np.arange(ITEMS // 2)
    export_validation(tmp_path / "calibration.jsonl", [(results, half)])
    export_validation(tmp_path / "fresh.jsonl", [(results, half + ITEMS // 2)])
    calibration = read_validation(tmp_path / "calibration.jsonl", "tierline/lm-edge")
    fresh = read_validation(tmp_path / "fresh.jsonl", "tierline/lm-edge")
    assert calibration.kinds is not None and len(calibration) == ITEMS // 2

    policy, _ = calibrate(calibration, max_quality_loss=0.01)
    promised = float(policy.calibration["edge_share"])
    assert set(policy.calibration["by_kind"]) <= {"easy", "hard"}
    live = float(np.mean(_confidence(policy, fresh) >= policy.threshold))
    allowed = tolerance(promised, len(calibration), len(fresh))
    assert abs(live - promised) <= allowed, (promised, live, allowed, policy.signal)
